"""Issue 53's producer: a step's generation under a decode budget, completions still running carried into the next
step (grpo_accel/generation/rollout_budget.py).

The scheduling checks run a scripted decoder whose every completion is a fixed token stream (its length coded in its
first token), so the reference is independent of the scheduler: what an unbudgeted decode would have produced. The
route checks run transformers' continuous batching on a tiny model: a completion decoded in budgeted rounds, each
round prefilling prompt + partial completion again, against one uninterrupted decode; its behaviour log-probs against
the model's own float64 forward over the same tokens.
"""

import json

import pytest
import torch

from grpo_accel.generation.continuous_batching import paged_decode
from grpo_accel.generation.rollout_budget import BudgetedRollouts

P, EOS = 3, 2  # the scripted prompts' length, the scripted EOS id


def stream(length: int) -> list[int]:
    """The scripted completion of `length` tokens: its first token codes the length, the last is EOS."""
    return [1000 + length] + [10 + k for k in range(1, length - 1)] + [EOS]


def scripted(lengths):
    """decode(): a new completion takes the next length from `lengths` (in the order completions start); a partial
    one continues its stream. Log-prob of token k: -(k + 1) / 100. Records each call's limits."""
    queue, calls = list(lengths), []

    def decode(sequences, limits):
        calls.append(list(limits))
        out = []
        for seq, limit in zip(sequences, limits):
            partial = seq[P:]
            full = stream(queue.pop(0) if not partial else partial[0] - 1000)
            assert full[:len(partial)] == partial  # the scheduler handed back exactly what it was given
            new = full[len(partial):len(partial) + limit]
            out.append((new, [-(len(partial) + k + 1) / 100 for k in range(len(new))], bool(new) and new[-1] == EOS))
        return out

    decode.calls = calls
    return decode


def prompts(first: int, n: int) -> list[list[int]]:
    return [[7, 7, first + i] for i in range(n)]


def test_a_step_ends_when_enough_groups_are_complete_and_carries_the_rest():
    r = BudgetedRollouts(num_generations=2, budget=4, max_completion_length=32, max_staleness=1)
    # step 0: g0 (3, 5), g1 (10, 4), g2 (2, 2), g3 (30, 6); two groups train
    decode = scripted([3, 5, 10, 4, 2, 2, 30, 6, 2, 3, 3, 3, 2, 2])
    r.add_prompts(prompts(0, 4), [{"row": i} for i in range(4)])
    ready, dropped = r.step(2, version=0, decode=decode)
    assert [g.group_id for g in ready] == [0, 2] and not dropped
    assert decode.calls == [[4] * 8, [4] * 4]  # round 2: g0's 5-long, g1's 10-long, g3's two; ended ones not asked
    assert [len(c.completion_ids) for c in r.buffer.groups[0].rollouts] == [8, 4]  # g1 carried mid-completion
    m = r.metrics()  # step 0's: 2 rounds; a slot idles once its completion ends; round 2 prefilled 4 x 4 again
    assert m["rollouts/rounds"] == 2 and m["rollouts/slot_use"] < 1 and m["rollouts/prefill_tokens_again"] == 16
    # step 1: two new groups; g1 ends in the first round under version 1, g4 and g5 too
    r.add_prompts(prompts(4, 2), [{"row": 4}, {"row": 5}])
    ready, dropped = r.step(2, version=1, decode=decode)
    assert [g.group_id for g in ready] == [1, 4] and not dropped  # oldest first: g1 started at version 0
    g1 = ready[0]
    assert g1.rollouts[0].completion_ids == stream(10) and g1.rollouts[0].versions == [0] * 8 + [1] * 2
    assert g1.rollouts[0].behaviour_logps == [-(k + 1) / 100 for k in range(10)]  # nothing decoded twice or lost
    assert g1.inputs == {"row": 1}  # the carried group's own dataset row, not the new batch's
    assert r.stats["prefill_tokens_again"] == 8 + 8  # step 1's round: g1's and g3's partial completions again
    # step 2: g3 (started at version 0, still running) is past the bound and dropped before it costs a round;
    # g5, complete since step 1, trains at staleness 1
    r.add_prompts(prompts(6, 1))
    ready, dropped = r.step(2, version=2, decode=decode)
    assert [g.group_id for g in dropped] == [3] and [g.group_id for g in ready] == [5, 6]
    m = r.metrics()
    assert m["rollouts/dropped_groups_total"] == 1 and m["rollouts/dropped_completion_tokens_total"] == 12 + 6


def test_a_budget_as_long_as_the_completion_limit_is_todays_step():
    """Budget >= max_completion_length and every group trained: one decode call at the full limit, every token of
    this version, nothing carried: the synchronous step."""
    r = BudgetedRollouts(num_generations=2, budget=64, max_completion_length=16)
    decode = scripted([3, 40, 16, 2])
    r.add_prompts(prompts(0, 2))
    ready, _ = r.step(2, version=5, decode=decode)
    assert decode.calls == [[16] * 4] and not r.buffer.groups
    got = [c.completion_ids for g in ready for c in g.rollouts]
    assert got == [stream(3), stream(40)[:16], stream(16), stream(2)]  # the 40-long one cut at the limit, ended
    assert all(c.finished and set(c.versions) == {5} for g in ready for c in g.rollouts)


def test_never_asks_past_the_completion_limit():
    r = BudgetedRollouts(num_generations=1, budget=5, max_completion_length=12)
    decode = scripted([50, 2])
    r.add_prompts(prompts(0, 2))
    ready, _ = r.step(2, version=0, decode=decode)
    assert decode.calls == [[5, 5], [5], [2]] and len(ready[0].rollouts[0].completion_ids) == 12


def test_a_checkpoint_mid_flight_resumes_the_carried_completions():
    """state_dict through JSON (what a checkpoint writes), loaded into a new object: the next steps give what the
    uninterrupted one gives, token for token."""
    lengths = [9, 3, 2, 2, 11, 5, 2, 2, 3, 3]

    def run(checkpoint: bool):
        r = BudgetedRollouts(num_generations=2, budget=3, max_completion_length=16)
        decode = scripted(lengths)
        r.add_prompts(prompts(0, 3))
        out = [r.step(1, version=0, decode=decode)[0]]
        if checkpoint:
            state = json.loads(json.dumps(r.state_dict()))
            r = BudgetedRollouts(num_generations=2, budget=3, max_completion_length=16)
            r.load_state_dict(state)
        r.add_prompts(prompts(3, 2))
        out.append(r.step(2, version=1, decode=decode)[0])
        return [(g.group_id, [c.completion_ids for c in g.rollouts], [c.versions for c in g.rollouts])
                for step in out for g in step], r.metrics()

    assert run(True) == run(False)


def test_a_decoder_that_overruns_its_limit_stops_the_step():
    r = BudgetedRollouts(num_generations=1, budget=2, max_completion_length=8)
    r.add_prompts(prompts(0, 1))
    with pytest.raises(RuntimeError, match="past its limit"):
        r.step(1, version=0, decode=lambda seqs, limits: [([5, 5, 5], [0.0] * 3, False) for _ in seqs])


# ------------------------------------------------------------------------------ the continuous-batching route
@pytest.fixture(scope="module")
def tiny():
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from grpo_accel.data.models import load_model

    torch.manual_seed(0)
    model, tok = load_model("tiny-llama")
    model.eval()
    for p in model.parameters():  # larger weights than the init: peaked logits, so a rounding cannot flip argmax
        p.data.mul_(8)
    gen = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    # a pool of a few pages: transformers sizes it from the host's free RAM otherwise (36 s to set up); pages of 4
    # tokens, so a round's continued sequences get full pages back from the round before (the prefix cache's path)
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=64)
    return model, tok, gen, cb


def test_budgeted_rounds_continue_the_completion_one_decode_would_give(tiny):
    """Greedy: rounds of 5 tokens (each prefilling prompt + partial again; the last one 2, the completion limit)
    against one 12-token decode."""
    model, tok, gen, cb = tiny
    prompt = tok("What is 2 + 3?")["input_ids"]
    with paged_decode(model, gen, cb) as decode:
        whole, _, _ = decode([prompt], [12])[0]
        # one round holds sequences with other limits (those near the completion limit): each stops at its own
        short, longer = decode([prompt, prompt], [3, 7])
    assert len(whole) == 12 and short[0] == whole[:3] and longer[0] == whole[:7]
    r = BudgetedRollouts(num_generations=1, budget=5, max_completion_length=12)
    r.add_prompts([prompt])
    with paged_decode(model, gen, cb) as decode:
        ready, _ = r.step(1, version=0, decode=decode)
    got = ready[0].rollouts[0]
    assert r.stats["rounds"] == 3 and got.completion_ids == whole  # rounds of 5, 5 and 2


def test_behaviour_logprobs_are_the_sampling_distributions_after_temperature(tiny):
    """Sampling at temperature 0.7 in rounds of 3: each token's log-prob as decoded equals log_softmax(logits / T)
    of the model's float64 forward over prompt + completion; the bound is the fp32 full forward's own error
    against float64, times 10 (the paged path sums in another order)."""
    import copy

    model, tok, gen, cb = tiny
    gen = copy.deepcopy(gen)
    gen.do_sample, gen.temperature, gen.top_k, gen.top_p = True, 0.7, 0, 1.0
    prompt = tok("Name a prime number.")["input_ids"]
    torch.manual_seed(1)
    r = BudgetedRollouts(num_generations=2, budget=3, max_completion_length=10)
    r.add_prompts([prompt])
    with paged_decode(model, gen, cb) as decode:
        ready, _ = r.step(1, version=0, decode=decode)

    def reference(m, ids, dtype):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].to(dtype)
        return torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]

    m64 = copy.deepcopy(model).double()
    for c in ready[0].rollouts:
        want = reference(m64, c.completion_ids, torch.float64)
        fp32_err = (reference(model, c.completion_ids, torch.float64) - want).abs().max().item()
        got = torch.tensor(c.behaviour_logps, dtype=torch.float64)
        assert (got - want).abs().max().item() <= 10 * max(fp32_err, torch.finfo(torch.float32).eps * want.abs().max())


def test_the_plan_holds_what_a_budgeted_run_keeps_in_flight():
    """The trainer's order (carried_rollouts.py): step k admits batch k + 1 ahead of it. Over many steps of a long
    tail, the sequences decoding at once stay within the pool the plan sizes (two generation batches), and the
    records' host bytes (tracemalloc-checked in test_rollouts.py) within the plan's host term."""
    from grpo_accel.planning.memory import plan_memory

    G, groups_per_step, C, P_ = 4, 2, 40, 3
    batch = G * groups_per_step
    plan = plan_memory("tiny-llama", num_generations=G, max_prompt_length=P_, max_completion_length=C,
                       per_device_train_batch_size=batch, generation="continuous_batching", rollout_budget=8,
                       device="cpu")
    off = plan_memory("tiny-llama", num_generations=G, max_prompt_length=P_, max_completion_length=C,
                      per_device_train_batch_size=batch, generation="continuous_batching", device="cpu")
    assert plan.device["paged_kv_cache"] > off.device["paged_kv_cache"] and "carried_rollouts" not in off.host
    lengths = [2 + (7 * k) % 60 for k in range(400)]  # a long tail, many past the limit
    decode, r = scripted(lengths), BudgetedRollouts(G, budget=8, max_completion_length=C)
    widest = []

    def watched(sequences, limits):
        widest.append(len(sequences))
        return decode(sequences, limits)

    r.add_prompts(prompts(0, groups_per_step))
    for step in range(10):
        r.add_prompts(prompts(100 + 10 * step, groups_per_step))  # the next batch, ahead
        r.step(groups_per_step, version=step, decode=watched)
        assert r.buffer.host_bytes() <= plan.host["carried_rollouts"]
    assert max(widest) <= 2 * batch and r.stats["carried_completions"] > 0  # the tail was carried
