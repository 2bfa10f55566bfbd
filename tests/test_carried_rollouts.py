"""--rollout_budget through the trainer (grpo_accel/trainer/carried_rollouts.py, issue 53): completions still running
when a step has its groups are carried into the next step, and the steps they train in are TRL's own.

The reference: TRL 1.16's GRPOTrainer fed what our run trained, step by step: the groups' dataset rows, their
completions and per-token behaviour log-probs (NaN where this step's policy sampled the token), and the RNG state our
step scored with; its importance-sampling correction on. Our savers off, so both sides run TRL's code: bit for bit.
"""

import copy
import math

import pytest
import torch
from support.rewards import length_reward
from support.trainers import STEP_RUN, assert_steps_equal, small_lora, step_run_config

from grpo_accel.core.errors import ConfigError
from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import build_tiny_model, load_model
from grpo_accel.trainer.carried_rollouts import BudgetMode
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.trainer import GRPOAccelTrainer

PROMPTS, BUDGET = 16, 2
ROWS, G, STEPS, C = (STEP_RUN[k] for k in ("per_device_train_batch_size", "num_generations", "max_steps",
                                           "max_completion_length"))
PLAIN = dict(logprob_impl="trl", padding_free=False, share_prompt="false")
POOL = dict(num_blocks=32, page_size=32, max_batch_tokens=256)
# A random tiny model samples SmolLM2's 49K tokens near uniformly and almost never its EOS: 10,000 ids that end a
# completion (as a model with several EOS ids does) make ~20% of tokens end one, so lengths vary and groups finish
# apart, which is what a budget is for
EOS_IDS = list(range(1000, 11000))


config, lora = step_run_config, small_lora  # support/trainers.py: the run TRL's side builds alike


# Weights' init std for the greedy check: at tiny-llama's 0.02 every greedy completion repeats one token whatever its
# context (a completion decoded again from its prompt would look the same); at 0.2 they differ by prompt and position,
# and 14 of the 16 prompts reach an EOS_IDS token within 16 tokens, at positions 0 to 8.
GREEDY_INIT_STD = 0.2


def ours(tmp_path, init_std=None, **extra):
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    if init_std is not None:
        model = build_tiny_model("tiny-llama", tokenizer, initializer_range=init_std)
    args = config(GRPOAccelConfig, tmp_path, **(PLAIN | dict(use_transformers_continuous_batching=True,
                                                           transformers_continuous_batching_config=POOL) | extra))
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", PROMPTS), peft_config=lora())
    trainer.generation_config.eos_token_id = [tokenizer.eos_token_id, *EOS_IDS]
    return trainer


def recording(monkeypatch):
    """Per scored batch: the rows, the groups (their versions), the tokens and log-probs handed to TRL, and the RNG
    state TRL's scoring started from."""
    seen, real = [], BudgetMode.generate_and_score

    def record(mode, trainer, inputs, score):
        def scored(rows):
            version, ready = mode.carried
            got = mode.single_turn(trainer, [g.prompt_ids for g in ready for _ in range(G)])
            seen.append(dict(rows=copy.deepcopy(rows), rng=torch.get_rng_state(), version=version, out=got,
                             versions=[list(r.versions) for g in ready for r in g.rollouts],
                             groups=copy.deepcopy(ready)))
            return score(rows)
        return real(mode, trainer, inputs, scored)

    monkeypatch.setattr(BudgetMode, "generate_and_score", record)
    return seen


class Replay:
    """TRL's `vllm_generation` for TRL's trainer: our completions and behaviour log-probs, batch by batch."""

    def __init__(self, seen):
        self.seen = list(seen)

    def sync_weights(self):
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        completion_ids, logps = self.seen.pop(0)["out"]
        return prompts, completion_ids, [[[x] for x in seq] for seq in logps], None


def trls(tmp_path, seen):
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    args = config(GRPOConfig, tmp_path)
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                          train_dataset=arithmetic_dataset("train", PROMPTS), peft_config=lora())
    args.use_vllm = trainer.use_vllm = True  # its correction on; the replay is its generation
    trainer.vllm_mode, trainer.vllm_generation, trainer._last_loaded_step = "server", Replay(seen), -1
    batches = list(seen)

    def fed(inputs):  # our step's rows and RNG state, not its own sampler's
        batch = batches.pop(0)
        torch.set_rng_state(batch["rng"])
        return GRPOTrainer._generate_and_score_completions(trainer, batch["rows"])

    trainer._generate_and_score_completions = fed
    return trainer


def test_carried_groups_train_as_trls_trainer_fed_the_same_rows_and_rollouts(tmp_path, monkeypatch):
    seen = recording(monkeypatch)
    trainer = ours(tmp_path / "ours", rollout_budget=BUDGET, max_staleness=1)
    trainer.train()
    assert len(seen) == STEPS
    carried = [v for batch in seen for v in batch["versions"] if len(set(v)) > 1]
    assert carried, "no completion was carried across a step: the test would not test the correction"
    for batch in seen:  # NaN exactly where this step's policy sampled the token: no correction there
        for versions, logps in zip(batch["versions"], batch["out"][1]):
            assert [math.isnan(x) for x in logps] == [v == batch["version"] for v in versions]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert max(h["rollouts/carried_completions"] for h in logs) > 0
    assert "sampling/importance_sampling_ratio/mean" in logs[0]
    # the decode rounds are the step's generation phase: a round of transformers' continuous batching, even of a
    # tiny model, is tens of milliseconds (time/generation_s is rounded to the millisecond)
    decoded = [h["time/generation_s"] for h in logs if h["rollouts/rounds"] > 0]
    assert decoded and min(decoded) >= 0.01, [(h["rollouts/rounds"], h["time/generation_s"]) for h in logs]

    reference = trls(tmp_path / "trl", seen)
    reference.train()
    assert_steps_equal(trainer, reference)


def test_carried_completions_are_the_greedy_decode_and_train_off_policy(tmp_path, monkeypatch):
    """References that are not the rollouts code: (1) decoding greedily, every completion a budgeted run trains, those
    carried across steps included, is transformers' `generate` of its prompt by the untrained model (greedy: a group's
    G completions are equal, its advantages 0, so the adapter never moves and every step's policy is the first);
    (2) sampling, with a learning rate that moves the adapter, a step that trains tokens an older adapter sampled
    shows TRL importance ratios other than 1 (TRL's own forward against the sampler's log-probs), and a step that
    trains none shows exactly 1 (nothing to correct)."""
    seen = recording(monkeypatch)
    greedy = ours(tmp_path / "greedy", init_std=GREEDY_INIT_STD, rollout_budget=BUDGET, max_staleness=STEPS,
                  generation_kwargs={"do_sample": False})  # nothing dropped: the long ones train, carried
    greedy.train()
    trained = [n for n, p in greedy.model.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert not trained, f"the greedy run moved its adapter ({trained[:2]}): the first policy is no reference"
    carried = [(g.prompt_ids, r) for batch in seen for g in batch["groups"] for r in g.rollouts
               if len(set(r.versions)) > 1]
    assert carried, "no completion was carried across a step: the test would not test the carry"
    _, tokenizer = load_model("tiny-llama")
    model = build_tiny_model("tiny-llama", tokenizer, initializer_range=GREEDY_INIT_STD)
    eos = [tokenizer.eos_token_id, *EOS_IDS]
    for prompt_ids, r in [(g.prompt_ids, r) for batch in seen for g in batch["groups"] for r in g.rollouts]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=C, eos_token_id=eos,
                                 pad_token_id=tokenizer.eos_token_id)
        assert r.completion_ids == out[0, len(prompt_ids):].tolist(), (r.versions, r.completion_ids)

    seen.clear()
    sampled = ours(tmp_path / "sampled", rollout_budget=BUDGET, learning_rate=1e-2)
    sampled.train()
    logs = [h for h in sampled.state.log_history if "loss" in h]
    older = [any(v < batch["version"] for vs in batch["versions"] for v in vs) for batch in seen]
    ratios = [(h["sampling/importance_sampling_ratio/min"], h["sampling/importance_sampling_ratio/max"]) for h in logs]
    assert any(older) and not all(older), older
    for step, (old, (low, high)) in enumerate(zip(older, ratios, strict=True)):
        if old:
            assert max(abs(low - 1), abs(high - 1)) > 1e-3, (step, ratios)
        else:
            assert low == high == 1.0, (step, ratios)


def test_an_option_that_cannot_carry_is_one_error_line(tmp_path):
    with pytest.raises(ConfigError, match="importance-sampling correction"):
        ours(tmp_path, rollout_budget=BUDGET, vllm_importance_sampling_correction=False)


def test_generate_says_it_cannot_pause_and_runs_as_without_a_budget(tmp_path, capsys):
    trainer = ours(tmp_path, rollout_budget=BUDGET, use_transformers_continuous_batching=False)
    assert not isinstance(trainer.generation_mode, BudgetMode) and not trainer.use_vllm
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "rollout_budget" in ln]
    assert len(lines) == 1 and "route generate cannot pause" in lines[0]


def test_a_checkpoint_holds_the_rollouts_in_flight_and_a_resume_continues_them(tmp_path, monkeypatch):
    """Saved at step 2 with completions in flight; a new trainer resumes from it: each saved group trains at step 3,
    stays in flight, or is dropped past the staleness bound, and one that goes on keeps its saved tokens and their
    versions; the batch admitted ahead before the save is not admitted again."""
    import json

    first = ours(tmp_path, rollout_budget=BUDGET, max_steps=2, save_steps=2)
    first.train()
    saved = json.loads((tmp_path / "checkpoint-2" / "rollouts-rank0.json").read_text())
    before = {g["group_id"]: g for g in saved["buffer"]["groups"]}
    assert any(r["completion_ids"] for g in before.values() for r in g["rollouts"]) and saved["ahead"]
    seen = recording(monkeypatch)
    second = ours(tmp_path, rollout_budget=BUDGET, max_steps=3, save_steps=100)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(seen) == 1  # step 3 only
    buffer = second.generation_mode.rollouts.buffer
    after = {g.group_id: g for g in [*seen[0]["groups"], *buffer.groups]}
    dropped = buffer.stats["dropped_groups"] - saved["buffer"]["stats"]["dropped_groups"]
    assert len([k for k in before if k in after]) + dropped == len(before)
    for k in before.keys() & after.keys():
        for r, old in zip(after[k].rollouts, before[k]["rollouts"], strict=True):
            n = len(old["completion_ids"])
            assert r.completion_ids[:n] == old["completion_ids"] and r.versions[:n] == old["versions"]
    admitted = [tuple(g["prompt_ids"]) for g in before.values()] + [
        tuple(g.prompt_ids) for k, g in after.items() if k not in before]
    assert len(admitted) == len(set(admitted)), "a prompt was admitted twice across the resume"


def test_the_budgeted_pool_is_the_planners_where_it_sizes_one(tmp_path, monkeypatch):
    """On CUDA the planner caps the pages in flight at what fits beside training (planned_paged_seqs; None on CPU:
    the whole batch): a budgeted step's manager takes that size, as the unbudgeted route's does, not a pool for every
    sequence of both batches."""
    from grpo_accel.generation import continuous_batching
    from grpo_accel.trainer import carried_rollouts

    trainer = ours(tmp_path, rollout_budget=BUDGET, transformers_continuous_batching_config={})
    asked, pools = [], []
    monkeypatch.setattr(carried_rollouts, "planned_paged_seqs",
                        lambda tr, prompt_tokens, batch: asked.append(batch) or 3)
    real = continuous_batching.paged_config

    def sized(*a, **k):
        cfg, line = real(*a, **k)
        pools.append((k.get("paged_seqs"), cfg.num_blocks, line))
        return cfg, line

    monkeypatch.setattr(continuous_batching, "paged_config", sized)
    trainer.args.max_steps = 1
    trainer.train()
    assert asked and asked[0] == 2 * ROWS  # this batch and the next, in flight together
    assert pools and all(seqs == 3 and "3 of 16 sequences" in line for seqs, _, line in pools), pools
