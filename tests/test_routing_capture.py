"""The sampler's own MoE routing on the route continuous_batching (grpo_accel/generation/routing_capture.py) and its
replay through the trainer (--routing_replay, issue 65).

The reference is independent of the capture: transformers' own forward of the finished sequence with
`output_router_logits=True`, its top-k taken here, under the sampler's weights. The capture must equal it at every
position but the last (never fed to the model: -1), including the positions a request did not compute itself (a
group's prompt prefilled once and forked, a budget round's pages served from the round before).

    OMP_NUM_THREADS=1 pytest tests/test_routing_capture.py -q -p no:xdist
"""

import pytest
import torch
from support.rewards import length_reward
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.generation.continuous_batching import generate_paged, paged_decode
from grpo_accel.generation.routing_capture import RoutingCapture
from grpo_accel.head.routing_replay import RoutingRecords, RoutingReplay, moe_shape

TWINS = ["tiny-gpt-oss", "tiny-qwen3-moe"]


def reference_routing(model, tokens: list[int]) -> torch.Tensor:
    """[n, L, k] the experts transformers' own forward routes each token of `tokens` to (sorted per layer)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = moe_shape(model)[1]
    return torch.stack([g.reshape(len(tokens), -1).topk(k, -1).indices for g in out.router_logits], 1).sort(-1).values


def assert_sampler_routing(model, tokens, routing):
    """Every position but the last as the reference routes it; the last has none."""
    assert routing.shape == (len(tokens), *moe_shape(model))
    assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()
    assert torch.equal(routing[:-1].long().sort(-1).values, reference_routing(model, tokens)[:-1])


@pytest.fixture(params=TWINS)
def twin(request):
    torch.manual_seed(0)
    tok = load_tokenizer(request.param)
    model = build_tiny_model(request.param, tok).eval()
    replay = RoutingReplay(model)
    patches = replay.install()
    yield model, tok, replay
    patches.undo()


def test_a_forked_group_records_the_samplers_routing_at_every_fed_token(twin):
    """Two prompts, 4 samples each: transformers prefills each prompt once and forks it (generate_paged sends a group
    once), so the forks' prompt positions come from the parent's forward (capture.routing holds -1 there)."""
    model, tok, replay = twin
    gen = GenerationConfig(do_sample=True, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=64)
    prompts = [tok("What is 2 + 3?")["input_ids"]] * 4 + [tok("Name a prime number, please.")["input_ids"]] * 4
    capture = RoutingCapture(replay)
    completions = generate_paged(model, prompts, gen, cb, capture=capture)
    for p, c, r in zip(prompts, completions, capture.last):
        assert_sampler_routing(model, p + c, r)
    unfed = [int((own[:, 0, 0] < 0).sum()) for own in capture.routing.values()]
    assert max(unfed) > 1  # some request computed less than its whole sequence: the fill was exercised


def test_budget_rounds_record_each_position_once_computed(twin):
    """Rounds of 4 then 5 tokens in one manager: the second round's full pages come from the first round's requests
    (the prefix cache; not on gpt-oss, whose sliding-window layers turn transformers' prefix sharing off: each round
    prefills again), its last token's routing from the forward that continues it."""
    model, tok, replay = twin
    gen = GenerationConfig(do_sample=True, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=64)
    prompts = [tok("What is 2 + 3?")["input_ids"], tok("Name a prime number, please.")["input_ids"]]
    capture = RoutingCapture(replay)
    with paged_decode(model, gen, cb, capture=capture) as decode:
        first = decode(prompts, [4, 4])
        sequences = [p + o[0] for p, o in zip(prompts, first)]
        second = decode(sequences, [5, 5])
    for seq, (ids, _, _, routing) in zip(sequences, second):
        assert_sampler_routing(model, seq + ids, routing)
    prefix_cache = "sliding_attention" not in (getattr(model.config, "layer_types", None) or [])
    assert any((own[:, 0, 0] < 0).sum() > 1 for own in capture.routing.values()) == prefix_cache


def moe_trainer(tmp_path, name, **extra):
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    torch.manual_seed(0)
    tok = load_tokenizer(name)
    model = build_tiny_model(name, tok)
    args = GRPOAccelConfig(**dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                                  max_completion_length=12, report_to="none", seed=0, beta=0.0, logging_steps=1,
                                  save_steps=100, bf16=False, use_transformers_continuous_batching=True,
                                  transformers_continuous_batching_config=dict(num_blocks=32, page_size=32,
                                                                               max_batch_tokens=256),
                                  offload_activations="false", routing_replay="true") | extra)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tok,
                               train_dataset=arithmetic_dataset("train", 16))
    trainer.generation_config.eos_token_id = [tok.eos_token_id, *range(1000, 11000)]  # lengths vary: groups end apart
    return trainer


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("budget", [0, 4], ids=["on_policy", "budget"])
@pytest.mark.parametrize("name", TWINS)
def test_the_trainer_replays_the_samplers_routing(tmp_path, monkeypatch, name, budget):
    """Through GRPOAccelTrainer on continuous batching (and with --rollout_budget, completions carried across
    steps): every row of every pass finds its record, no routing ran elsewhere than recorded, flips are measured,
    and each record is what a reference forward of the sampler's weights routes. Learning rate 0 keeps every step's
    weights the sampler's, so a carried token's record has one reference."""
    kept, real = [], RoutingRecords.replace

    def replace(records, by_tokens):
        kept.extend((tokens, r.clone()) for tokens, r in by_tokens.items())
        return real(records, by_tokens)

    monkeypatch.setattr(RoutingRecords, "replace", replace)
    trainer = moe_trainer(tmp_path, name, rollout_budget=budget, max_steps=3, learning_rate=0.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and len(kept) >= 3 * 8
    for h in logs:
        assert h["routing/applied_flip_frac"] == 0 and h["routing/recorded_rows"] == 1
        assert 0 <= h["routing/flip_frac"] <= 1
    if budget:
        assert sum(h["rollouts/carried_completions"] for h in logs) > 0
    model = trainer.model
    for tokens, routing in kept:
        assert_sampler_routing(model, list(tokens), routing)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_route_that_records_no_routing_is_one_line_or_one_error(tmp_path, capsys):
    """generate() records no routing: auto turns replay off with one line naming why, true is refused naming the
    route that records it."""
    from grpo_accel.core.errors import ConfigError

    trainer = moe_trainer(tmp_path, "tiny-qwen3-moe", use_transformers_continuous_batching=False,
                          routing_replay="auto")
    assert trainer.routing_replay is None
    lines = [x for x in capsys.readouterr().out.splitlines() if "routing_replay" in x]
    assert len(lines) == 1 and "route generate records no routing" in lines[0]
    with pytest.raises(ConfigError, match="--routing_replay true cannot run: route generate.*"
                                          "--use_transformers_continuous_batching true"):
        moe_trainer(tmp_path, "tiny-qwen3-moe", use_transformers_continuous_batching=False)


def test_the_planner_counts_the_records_a_generation_batch_keeps(twin):
    """plan_memory's host term `routing_records` against what a generation batch's records hold: 8 sequences of P + C
    tokens (every completion C tokens long); the experts' tensors exactly, their keys (tuples of token ids) measured
    by Python's own sizes. No term with replay off, nor on a dense model."""
    import sys

    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.memory import plan_memory

    model, tok, replay = twin
    P, C, G = 9, 7, 4
    gen = GenerationConfig(do_sample=True, max_new_tokens=C, min_new_tokens=C, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    prompts = [list(range(100, 100 + P))] * G + [list(range(200, 200 + P))] * G
    capture = RoutingCapture(replay)
    completions = generate_paged(model, prompts, gen, ContinuousBatchingConfig(num_blocks=64, page_size=4),
                                 capture=capture)
    records = RoutingRecords()
    records.replace({tuple(p + c): r for p, c, r in zip(prompts, completions, capture.last)})
    keys = sum(sys.getsizeof(k) + sum(map(sys.getsizeof, k)) for k in records._by_tokens)
    plan = dict(model_dtype="fp32", lora_r=0, num_generations=G, max_prompt_length=P, max_completion_length=C,
                per_device_train_batch_size=2 * G, generation="continuous_batching", device="cpu")
    term = plan_memory(model_shape(model.config), **plan).host["routing_records"]
    L, k = moe_shape(model)
    assert records.host_bytes() == 2 * G * (P + C) * L * k * 2
    assert records.host_bytes() + keys <= term < 1.2 * (records.host_bytes() + keys)
    assert "routing_records" not in plan_memory(model_shape(model.config), **plan, routing_replay="false").host
    assert "routing_records" not in plan_memory("tiny-llama", **plan).host


def test_a_rollout_keeps_each_positions_first_routing_and_a_checkpoint_keeps_it():
    """A carried completion's prefix is prefilled again under newer weights: its positions keep the routing they had
    when the tokens after them were sampled, new positions take the new round's; JSON (the checkpoint) round-trips."""
    import json

    from grpo_accel.generation.rollouts import Rollout, RolloutBuffer, RolloutGroup

    r = Rollout()
    first = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]], dtype=torch.int16)  # prompt of 2, one token, unfed
    r.extend([7], [-0.5], version=0, finished=False, routed_experts=first)
    later = torch.tensor([[[1, 0]], [[3, 1]], [[2, 0]], [[-1, -1]]], dtype=torch.int16)
    r.extend([8], [-0.7], version=1, finished=True, routed_experts=later)
    assert r.routed_experts.tolist() == [[[0, 1]], [[2, 3]], [[2, 0]], [[-1, -1]]]
    buffer = RolloutBuffer(1)
    buffer.add(RolloutGroup(0, [5, 6], [r]))
    back = RolloutBuffer.from_state_dict(json.loads(json.dumps(buffer.state_dict())))
    got = back.groups[0].rollouts[0].routed_experts
    assert got.dtype == torch.int16 and torch.equal(got, r.routed_experts)
