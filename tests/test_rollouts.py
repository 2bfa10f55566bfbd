"""The versioned rollout record (grpo_accel/generation/rollouts.py) that server-side async steps and partial rollouts
share: which groups may train at a policy version, what is dropped and counted, and a checkpoint round trip."""

import json
import random
import tracemalloc

import pytest

from grpo_accel.generation.rollouts import Rollout, RolloutBuffer, RolloutGroup


def group(gid, spans, G=2):
    """A group whose completion i was sampled in spans [(version, n_tokens, finished), ...]."""
    rollouts = []
    for i in range(G):
        r = Rollout()
        for version, n, finished in spans[i] if i < len(spans) else spans[-1]:
            r.extend([1000 + gid * 10 + k for k in range(n)], [-0.5] * n, version, finished)
        rollouts.append(r)
    return RolloutGroup(gid, [1, 2, 3], rollouts, {"answer": str(gid)})


def test_complete_groups_within_the_bound_go_out_oldest_first_and_older_ones_are_dropped_and_counted():
    buf = RolloutBuffer(num_generations=2, max_staleness=1)
    buf.add(group(0, [[(3, 5, True)], [(3, 40, True)]]))  # complete, sampled at 3
    buf.add(group(1, [[(4, 4, True)], [(4, 6, True)]]))  # complete, at 4
    buf.add(group(2, [[(2, 3, True)], [(2, 30, False), (4, 10, True)]]))  # a long one carried from 2 to 4
    buf.add(group(3, [[(5, 2, True)], [(5, 9, False)]]))  # still running
    ready, dropped = buf.take(n_groups=1, version=4)
    assert [g.group_id for g in ready] == [0]  # oldest complete group within staleness 1
    assert [g.group_id for g in dropped] == [2]  # staleness 2: its oldest tokens are past the bound
    assert buf.stats["dropped_completion_tokens"] == 3 + 40  # the dropped group's length: the short-bias, measured
    assert [g.group_id for g in buf.partial] == [3]
    ready, dropped = buf.take(n_groups=4, version=5)
    assert [g.group_id for g in ready] == [1] and dropped == []  # group 3 waits for its last completion
    assert buf.stats["taken_groups"] == 2 and buf.stats["dropped_groups"] == 1


def test_staleness_zero_is_on_policy_only():
    buf = RolloutBuffer(num_generations=2, max_staleness=0)
    buf.add(group(0, [[(7, 3, True)]]))
    ready, dropped = buf.take(1, version=8)
    assert ready == [] and [g.group_id for g in dropped] == [0]
    buf.add(group(1, [[(8, 3, True)]]))
    assert [g.group_id for g in buf.take(1, version=8)[0]] == [1]


def test_a_record_refuses_what_cannot_be_corrected():
    r = Rollout()
    r.extend([1, 2], [-0.1, -0.2], version=3, finished=False)
    with pytest.raises(ValueError, match="versions only grow"):
        r.extend([3], [-0.3], version=2, finished=False)
    with pytest.raises(ValueError, match="2 tokens but 1"):
        r.extend([3, 4], [-0.3], version=3, finished=False)
    r.extend([3], [-0.3], version=4, finished=True)
    assert r.versions == [3, 3, 4] and r.oldest_version == 3
    with pytest.raises(ValueError, match="has ended"):
        r.extend([5], [-0.1], version=4, finished=True)
    with pytest.raises(ValueError, match="num_generations=2"):
        RolloutBuffer(2).add(RolloutGroup(0, [1], [Rollout()]))


def test_checkpoint_round_trip_keeps_every_token_and_the_counts():
    buf = RolloutBuffer(num_generations=2, max_staleness=1)
    buf.add(group(0, [[(1, 4, True)], [(1, 7, False)]]))
    buf.add(group(1, [[(0, 9, True)], [(1, 2, True)]]))
    buf.take(0, version=2)  # drops group 1 (staleness 2): the counts must survive the round trip too
    state = json.loads(json.dumps(buf.state_dict()))
    again = RolloutBuffer.from_state_dict(state)
    assert again.state_dict() == buf.state_dict() and again.stats["dropped_groups"] == 1
    assert again.partial[0].rollouts[1].completion_ids == buf.partial[0].rollouts[1].completion_ids


def test_host_bytes_is_never_under_what_python_holds():
    """The planner's host-memory term for carried records, against tracemalloc's count of the same objects (token ids
    past Python's small-int cache, random behaviour log-probs: every value its own object)."""
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    groups = []
    for gid in range(8):
        rollouts = []
        for _ in range(4):
            r = Rollout()
            n = rng.randint(50, 400)
            r.extend([rng.randint(1000, 150000) for _ in range(n)], [rng.uniform(-5, 0) for _ in range(n)],
                     version=rng.randint(1000, 2000), finished=True)
            rollouts.append(r)
        groups.append(RolloutGroup(gid, [rng.randint(1000, 150000) for _ in range(64)], rollouts))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    planned = sum(g.host_bytes() for g in groups)
    assert held <= planned <= 1.25 * held, (held, planned, planned / held)


def _reads_of_use_vllm() -> dict[str, tuple[int, int]]:
    """{GRPOTrainer method: (reads of self.use_vllm, reads of vllm_importance_sampling_correction)}, from TRL's
    source as installed."""
    import ast
    import inspect

    import trl.trainer.grpo_trainer as grpo

    reads = {}
    for node in ast.walk(ast.parse(inspect.getsource(grpo))):
        if isinstance(node, ast.ClassDef) and node.name == "GRPOTrainer":
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                attrs = [x for x in ast.walk(fn) if isinstance(x, ast.Attribute)]
                n = sum(1 for x in attrs if x.attr == "use_vllm" and isinstance(x.value, ast.Name)
                        and x.value.id == "self")
                m = sum(1 for x in attrs if x.attr == "vllm_importance_sampling_correction")
                if n or m:
                    reads[fn.name] = (n, m)
    return reads


def test_trls_correction_is_gated_where_the_design_says():
    """docs/off-policy-rollouts.md: both producers hand TRL their behaviour log-probs through `_generate` and let
    TRL's own importance-sampling correction run by reading `use_vllm` as true. That is sound only while TRL reads
    `use_vllm` in the correction path (scoring, loss) and in the generation methods the producers replace, nowhere
    else. TRL 1.16.0's reads, counted from its source; an upgrade that moves them fails here, before a loss changes."""
    assert _reads_of_use_vllm() == {
        "__init__": (3, 4),  # building TRL's own vLLM generation: before a producer is set
        "_generate_single_turn": (1, 0), "_tool_call_loop": (1, 0), "_generate": (1, 0),  # generation: replaced
        "_generate_and_score_completions": (4, 4),  # old log-probs, the ratio, its metrics, the output dict
        "_compute_loss": (1, 1),  # the ratio times the per-token loss
    }
