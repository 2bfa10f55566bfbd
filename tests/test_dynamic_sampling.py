"""--dynamic_sampling (grpo_accel/trainer/dynamic_sampling.py, issue 66): groups whose rewards are all equal leave the
batch, refill rounds bring groups with a spread.

References: exact equality of rewards the test computes itself (flat_groups); the same run with it off (a batch whose
groups all have a spread trains bit for bit as without it); TRL 1.16's GRPOTrainer fed the groups our run kept (their
dataset rows and completions, and the RNG state our step shuffled with), savers off so both sides run TRL's code; the
uninterrupted run for a resumed one.
"""

import math

import pytest
import torch
from support.compare import assert_equal
from support.rewards import half_flat_reward, length_reward
from support.trainers import STEP_RUN, small_lora, step_run_config

from grpo_accel.core.errors import ConfigError
from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.dynamic_sampling import RTOL, flat_groups
from grpo_accel.trainer.trainer import GRPOAccelTrainer

PROMPTS = 16
ROWS, G, STEPS, C = (STEP_RUN[k] for k in ("per_device_train_batch_size", "num_generations", "max_steps",
                                           "max_completion_length"))
PLAIN = dict(logprob_impl="trl", padding_free=False, share_prompt="false")
EOS_IDS = list(range(1000, 11000))  # ~20% of a random tiny model's tokens end a completion: lengths differ


def constant_reward(prompts, completions, **kwargs):
    return [0.2] * len(completions)


config, lora = step_run_config, small_lora  # support/trainers.py: the run TRL's side builds alike


def ours(tmp_path, reward=half_flat_reward, **extra):
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    args = config(GRPOAccelConfig, tmp_path, **(PLAIN | extra))
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", PROMPTS), peft_config=lora())
    trainer.generation_config.eos_token_id = [tokenizer.eos_token_id, *EOS_IDS]
    return trainer


def steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_flat_groups_is_exact_equality_up_to_the_rewards_scale():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0,  # flat
                            0.0, 0.0, 0.0, 1.0,  # a spread
                            0.2, 0.2, 0.2, 0.2 + 1e-9,  # float residue of a weighted sum: flat
                            0.5, 0.5, 0.5 + 1e-3, 0.5,  # a real difference
                            math.nan, 2.0, 2.0, 2.0,  # a completion no reward scored: left out
                            math.nan, math.nan, math.nan, math.nan])
    assert flat_groups(rewards, 4).tolist() == [True, False, True, False, True, True]
    big = torch.tensor([1000.0, 1000.0 + 1000 * RTOL / 2, 3.0, 7.0])  # the tolerance scales with the rewards
    assert flat_groups(big, 2).tolist() == [True, False]


def test_equal_rewards_are_seen_where_trls_tolerance_misses_the_float_residue(tmp_path):
    """Eight completions scored 0.2 each: TRL's nanstd leaves ~1.6e-8, above its isclose's 1e-8, so TRL logs
    frac_reward_zero_std 0; the trainer logs 1 (with dynamic sampling off) and the no-signal watch says so."""
    from trl.trainer.utils import nanstd

    residue = nanstd(torch.full((1, 8), 0.2), dim=1)
    assert not torch.isclose(residue, torch.zeros_like(residue)), "TRL's test would see it: this checks nothing"
    trainer = ours(tmp_path, reward=constant_reward, num_generations=8, max_steps=1)
    trainer.train()
    assert steps(trainer)[0]["frac_reward_zero_std"] == 1.0
    assert any("every group's completions got equal rewards" in w for w in trainer.learning_signal.warnings)


# --rollout_budget over continuous batching: rounds of 2 tokens against the limit of 16, so groups finish apart and
# completions are carried (the EOS ids above end ~20% of tokens)
BUDGET = dict(rollout_budget=2, use_transformers_continuous_batching=True, vllm_importance_sampling_correction=True)


@pytest.mark.parametrize("route", ["generate", "budget"])
def test_with_every_group_spread_it_is_the_run_without_it_bit_for_bit(tmp_path, route):
    extra = BUDGET if route == "budget" else {}
    off = ours(tmp_path / "off", reward=length_reward, **extra)
    off.train()
    assert all(h["frac_reward_zero_std"] == 0 for h in steps(off)), "a flat group: this would test a refill"
    on = ours(tmp_path / "on", reward=length_reward, dynamic_sampling=True, **extra)
    on.train()
    for a, b in zip(steps(on), steps(off), strict=True):
        assert a["dynamic_sampling/rounds"] == 1 and a["dynamic_sampling/groups_kept"] == ROWS // G
        for key, value in b.items():
            if not key.startswith(("time/", "memory/")) and key not in ("step_time", "train_runtime"):
                assert a[key] == value or math.isnan(value) and math.isnan(a[key]), key
    for p, q in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(p, q)


class Replay:
    """TRL's `vllm_generation` for TRL's trainer: the completions our run kept, batch by batch."""

    def __init__(self, batches):
        self.batches = batches

    def sync_weights(self):
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        ids = self.batches.pop(0)
        return prompts, ids, [[[0.0] for _ in seq] for seq in ids], None


def recording(monkeypatch, trainer):
    """Each round TRL scored (rows and completions) and each step's kept batch (and the RNG state it shuffled with)."""
    from trl import GRPOTrainer

    rounds, kept = [], []
    trls = GRPOTrainer._generate_and_score_completions

    def round_(self, rows):
        out = trls(self, rows)
        rounds.append((rows, _completions(out)))
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", round_)
    ours_ = type(trainer)._generate_and_score_completions

    def step(self, inputs):
        first = len(rounds)
        out = ours_(self, inputs)
        kept.append({"rounds": rounds[first:], "out": _completions(out), "rng": torch.get_rng_state()})
        return out

    monkeypatch.setattr(type(trainer), "_generate_and_score_completions", step)
    return kept


def _completions(out):
    return [ids[mask.bool()].tolist() for ids, mask in zip(out["completion_ids"], out["completion_mask"])]


def batches_kept(kept) -> tuple[list, list]:
    """Per step, the rows and completions the test itself chooses from the rounds TRL scored: the first groups, in
    round order, whose answer is odd (half_flat_reward's spread), then the flat ones in round order where the rounds
    found too few; each must be what the step trained."""
    fed_rows, fed_ids = [], []
    for k in kept:
        rows, ids = [], []
        for spread in (True, False):
            for round_rows, round_ids in k["rounds"]:
                for g in range(0, len(round_rows), G):
                    if bool(int(round_rows[g]["answer"]) % 2) == spread and len(rows) < ROWS:
                        rows += round_rows[g:g + G]
                        ids += round_ids[g:g + G]
        assert ids == k["out"]
        fed_rows.append(rows)
        fed_ids.append(ids)
    return fed_rows, fed_ids


def test_kept_groups_train_as_trls_trainer_fed_those_groups(tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    trainer = ours(tmp_path / "ours", dynamic_sampling=True, max_sampling_rounds=4)
    kept = recording(monkeypatch, trainer)
    trainer.train()
    monkeypatch.undo()
    assert len(kept) == STEPS and any(len(k["rounds"]) > 1 for k in kept), "no refill: the test would test nothing"
    fed_rows, fed_ids = batches_kept(kept)
    logs = steps(trainer)
    assert sum(h["dynamic_sampling/dropped_all_right"] + h["dynamic_sampling/dropped_all_wrong"] for h in logs) > 0

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    args = config(GRPOConfig, tmp_path / "trl", vllm_importance_sampling_correction=False)
    reference = GRPOTrainer(model=model, reward_funcs=[half_flat_reward], args=args, processing_class=tokenizer,
                            train_dataset=arithmetic_dataset("train", PROMPTS), peft_config=lora())
    args.use_vllm = reference.use_vllm = True
    reference.vllm_mode, reference.vllm_generation, reference._last_loaded_step = "server", Replay(fed_ids), -1
    rngs = [k["rng"] for k in kept]

    def fed(inputs):
        out = GRPOTrainer._generate_and_score_completions(reference, fed_rows.pop(0))
        torch.set_rng_state(rngs.pop(0))  # the state our step went on with (its refill rounds drew from it)
        return out

    reference._generate_and_score_completions = fed
    reference.train()
    for key in ("loss", "grad_norm", "entropy"):
        assert [h[key] for h in steps(trainer)] == [h[key] for h in steps(reference)], key

    def adapter(t):
        return {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_" in n}

    assert_equal(adapter(trainer), adapter(reference))


def test_on_a_rollout_budget_refill_rounds_join_the_groups_in_flight(tmp_path, monkeypatch):
    """--rollout_budget: a refill round's prompts join the groups in flight and the round trains the first complete
    ones (groups started ahead or carried before the new prompts). Each prompt is admitted once: the batch a step
    started ahead is not admitted again by the next step after a refill (the in-flight record counts admissions);
    the batch each step trained is the one the test chooses from the rounds TRL scored."""
    trainer = ours(tmp_path, dynamic_sampling=True, max_sampling_rounds=4, **BUDGET)
    kept = recording(monkeypatch, trainer)
    asked, take = [], trainer.dynamic_sampling.source.take

    def taking(*a):
        asked.append(take(*a))
        return asked[-1]

    monkeypatch.setattr(trainer.dynamic_sampling.source, "take", taking)
    trainer.train()
    monkeypatch.undo()
    logs = steps(trainer)
    assert any(h["dynamic_sampling/rounds"] > 1 for h in logs), "no refill: the test would test nothing"
    assert any(h["rollouts/carried_completions"] > 0 for h in logs), "nothing carried: no budget at work"
    batches_kept(kept)
    refill_rounds = [rows for k in kept for rows, _ in k["rounds"][1:]]
    assert len(refill_rounds) == len(asked)
    # a refill round trained groups that were in flight before its prompts joined them
    assert any([r["question"] for r in got] != [r["question"] for r in new] for got, new in zip(refill_rounds, asked))
    groups = ROWS // G
    refills = sum(h["dynamic_sampling/groups_sampled"] - groups for h in logs)
    ahead = groups if STEPS * groups < PROMPTS else 0  # the batch after the last step, started ahead of it
    assert trainer.generation_mode.rollouts.next_group_id == STEPS * groups + ahead + refills


@pytest.mark.parametrize("route", ["generate", "budget"])
def test_a_resumed_run_samples_the_refills_of_the_uninterrupted_one(tmp_path, route):
    extra = BUDGET if route == "budget" else {}
    whole = ours(tmp_path / "whole", dynamic_sampling=True, save_steps=2, **extra)
    whole.train()
    assert any(h["dynamic_sampling/rounds"] > 1 for h in steps(whole)[2:]), "no refill after the checkpoint"
    resumed = ours(tmp_path / "whole", dynamic_sampling=True, save_steps=2, **extra)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    for a, b in zip(steps(resumed)[-2:], steps(whole)[2:], strict=True):
        for key in ("loss", "grad_norm", *(k for k in b if k.startswith("dynamic_sampling/") and not k.endswith("_s"))):
            assert a[key] == b[key], key
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)


def test_rounds_are_bounded_and_a_short_batch_trains_on_what_it_has(tmp_path):
    trainer = ours(tmp_path, reward=constant_reward, dynamic_sampling=True, max_sampling_rounds=2, max_steps=3)
    trainer.train()
    for h in steps(trainer):
        assert h["dynamic_sampling/rounds"] == 2 and h["dynamic_sampling/groups_kept"] == 0
        assert h["dynamic_sampling/filled_with_flat_groups"] == ROWS // G
        assert h["dynamic_sampling/groups_sampled"] == 2 * ROWS // G


def test_groups_split_across_processes_are_refused():
    """2 rows a process with G=4 on 2 processes (TRL allows it: the global batch holds whole groups): a group
    would be kept or dropped on two ranks at once."""
    from types import SimpleNamespace

    from grpo_accel.trainer.dynamic_sampling import DynamicSampling

    args = SimpleNamespace(sequence_parallel_size=1, per_device_train_batch_size=2, steps_per_generation=1,
                           max_sampling_rounds=3, seed=0)
    trainer = SimpleNamespace(args=args, num_generations=4, train_dataset=list(range(8)))
    with pytest.raises(ConfigError, match="whole groups on each process"):
        DynamicSampling(trainer)


def test_the_planner_holds_every_rounds_output(tmp_path, monkeypatch):
    """planning.generation.sampling_round_bytes against the tensors the rounds of a real generation batch held (each
    round's TRL output, then the merged batch): an upper bound, at most 2x over (it counts three log-prob tensors;
    this run holds none but the ids and masks, and pads to the longest prompt)."""
    from trl import GRPOTrainer

    from grpo_accel.planning.generation import sampling_round_bytes

    held, widths = [], []
    trls = GRPOTrainer._generate_and_score_completions

    def round_(self, rows):
        out = trls(self, rows)
        held.append(sum(v.nbytes for v in out.values() if isinstance(v, torch.Tensor) and v.dim() > 0))
        widths.append(out["prompt_ids"].size(1))
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", round_)
    trainer = ours(tmp_path, reward=constant_reward, dynamic_sampling=True, max_sampling_rounds=3, max_steps=1)
    trainer.train()
    assert len(held) == 3
    planned = sampling_round_bytes(ROWS, max(widths), C, 3)
    assert sum(held) <= planned <= 2 * sum(held) + 3 * ROWS * 12 * C


def test_refill_prompts_go_through_the_dataset_once_a_pass_and_ranks_take_apart():
    """Two processes (a source each, as each process holds its own) taking 3 groups a round: their prompts never
    overlap, and every prompt comes once before any comes again (a permutation per pass over the dataset), each
    repeated G times in a row; a later pass is another order."""
    from grpo_accel.trainer.dynamic_sampling import PromptSource

    data = [{"i": i} for i in range(12)]
    sources = [PromptSource(data, seed=0, num_generations=G) for _ in (0, 1)]
    passes = []
    for _ in range(2):
        taken = []
        for _ in range(2):  # two rounds of 2 ranks x 3 groups: one whole pass
            for rank, source in enumerate(sources):
                rows = source.take(3, rank, 2)
                assert all(rows[k]["i"] == rows[k - k % G]["i"] for k in range(len(rows)))
                taken += [row["i"] for row in rows[::G]]
        assert sorted(taken) == list(range(12))
        passes.append(taken)
    assert passes[0] != passes[1] and all(s.cursor == 24 for s in sources)
