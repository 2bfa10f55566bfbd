"""Dynamic sampling (DAPO's): a group whose completions all got the same reward does not enter a step's batch.

A GRPO group whose G rewards are equal has advantage 0 on every token: it costs a generation and a backward, teaches
nothing, and dilutes the step's loss (averaged over its tokens). With --dynamic_sampling the trainer keeps the groups
with a spread and samples further prompts in rounds to fill the batch, at most --max_sampling_rounds rounds a
generation batch (DAPO's max_num_gen_batches); a batch still short then trains on what it has, the flat groups of the
rounds filling it (as plain GRPO would), and says so in its metrics.

- Equal as the user means it (`flat_groups`): every reward of the group within RTOL of the rewards' scale, not TRL's
  `isclose(std, 0)` at its absolute 1e-8, which the float residue of a weighted reward sum passes as a spread. The
  same test feeds `frac_reward_zero_std` as the trainer logs it, on or off.
- Each round is TRL's own `_generate_and_score_completions` (through the route's mode): rewards scored once per
  completion, advantages per whole group as TRL computes them. Where a route holds groups already sampled, a refill
  round takes those first: with --rollout_budget its prompts join the groups in flight and it trains the first
  complete ones, oldest first (the batch started ahead, completions carried); a vLLM server samples a refill round
  then and there, leaving the batch it was asked for ahead queued for its step. The kept groups' rows are taken out
  of the rounds' outputs and padded as TRL pads one batch of them (`merge`), so the step trains as TRL's trainer fed
  those groups.
- Rounds run in lockstep on every process (each samples the most groups any process lacks): TRL's gathers are
  collective, and every rank trains the same number of groups.
- Refill prompts come from a seeded order of the training set of their own (`PromptSource`), not from the sampler
  the steps read, so the steps' data order is the one without dynamic sampling; the prompts taken are counted and the
  count is saved with each checkpoint.
Cost with every group spread: one all-reduce of an int per generation batch; the batch is TRL's, bit for bit.
"""

from __future__ import annotations

import json
import os
import time

import torch

from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError

RTOL = 1e-5  # of the batch's largest |reward|: float32 sums of weighted rewards are good to ~1e-7 of it
STATE_FILE = "dynamic_sampling.json"
BOUND_STREAK = 3  # fills in a row that ran out of rounds before the run says what that means


def flat_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] bool: every reward of the group equal within RTOL x the batch's largest |reward| (NaN, a completion
    no reward scored, left out as TRL's baseline leaves it; a group of only NaN is flat). rewards: [rows], grouped
    G consecutive rows, as TRL's RepeatSampler lays them out."""
    grouped = rewards.view(-1, num_generations)
    scored = ~grouped.isnan()
    scale = grouped.abs().nan_to_num(0.0).max()
    hi = grouped.masked_fill(~scored, float("-inf")).max(dim=1).values
    lo = grouped.masked_fill(~scored, float("inf")).min(dim=1).values
    spread = (hi - lo).nan_to_num(0.0).clamp(min=0.0)
    return ~(spread > RTOL * scale) | ~scored.any(dim=1)


class PromptSource:
    """The prompts refill rounds sample: the training set in a seeded order of its own (the run's seed + 1, each pass
    reshuffled), each prompt num_generations times in a row as TRL's RepeatSampler yields it. `cursor` counts the
    prompts every process has taken; a process takes its share of each round by its index."""

    def __init__(self, dataset, seed: int, num_generations: int):
        self.dataset, self.seed, self.num_generations = dataset, seed, num_generations
        self.cursor, self._orders = 0, {}

    def take(self, groups: int, rank: int, world: int) -> list[dict]:
        first = self.cursor + rank * groups
        indices = [self._index(first + i) for i in range(groups)]
        self.cursor += groups * world
        return [self.dataset[i] for i in indices for _ in range(self.num_generations)]

    def _index(self, k: int) -> int:
        epoch, position = divmod(k, len(self.dataset))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + 1 + epoch)
            self._orders = {epoch: torch.randperm(len(self.dataset), generator=generator).tolist()}
        return self._orders[epoch][position]


def _refusal(trainer) -> str | None:
    args = trainer.args
    if getattr(trainer, "sequence_parallel", None) is not None or getattr(args, "sequence_parallel_size", 1) > 1:
        return "--dynamic_sampling does not run under sequence parallelism yet (an SP group shares its prompts)"
    if not hasattr(trainer.train_dataset, "__getitem__") or not hasattr(trainer.train_dataset, "__len__"):
        return "--dynamic_sampling needs a map-style training dataset (refill prompts are read by index)"
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if rows % trainer.num_generations:
        return (f"--dynamic_sampling needs whole groups on each process: per_device_train_batch_size x "
                f"steps_per_generation ({rows}) is not a multiple of num_generations ({trainer.num_generations})")
    return None


class DynamicSampling:
    """The trainer's dynamic sampling (module docstring): `fill` one generation batch, `metrics` per logged step,
    `save` / `load` the refill cursor with a checkpoint."""

    def __init__(self, trainer):
        refusal = _refusal(trainer)
        if refusal:
            raise ConfigError(f"{refusal}. Fix: drop --dynamic_sampling, or the option named.")
        args = trainer.args
        self.num_generations = trainer.num_generations
        self.groups = args.per_device_train_batch_size * args.steps_per_generation // self.num_generations
        self.max_rounds = args.max_sampling_rounds
        self.source = PromptSource(trainer.train_dataset, args.seed, self.num_generations)
        self.reward_range = [float("inf"), float("-inf")]  # every reward seen: where "all right" lies
        self.bound_streak, self.said_bound = 0, False
        self._metrics: dict[str, float] = {}
        self._dropped: dict[str, float] = {}  # this batch's flat groups, all right / all wrong

    def fill(self, trainer, inputs: list[dict], score, refill) -> dict:
        """One generation batch of `self.groups` groups with a spread where `max_rounds` rounds find them.
        score(rows) -> TRL's output for the step's rows, refill(rows) -> for a refill round's (the generation mode's
        generate_and_score and refill_and_score); after either, trainer.round_rewards holds their gathered rewards."""
        out = score(inputs)
        parts, flat_pool = [], []
        self._dropped = {"dynamic_sampling/dropped_all_right": 0.0, "dynamic_sampling/dropped_all_wrong": 0.0}
        need = self._sort(trainer, out, parts, flat_pool, self.groups)
        sampled, rounds, started = self.groups, 1, time.perf_counter()
        while rounds < self.max_rounds and (ask := self._most_needed(trainer, need)) > 0:
            rows = self.source.take(ask, trainer.accelerator.process_index, trainer.accelerator.num_processes)
            need = self._sort(trainer, refill(rows), parts, flat_pool, need)
            sampled, rounds = sampled + ask, rounds + 1
        extra_s = time.perf_counter() - started if rounds > 1 else 0.0
        filled = flat_pool[:need]
        self._note_bound(rounds, len(filled))
        self._metrics = {"dynamic_sampling/groups_sampled": float(sampled), "dynamic_sampling/rounds": float(rounds),
                         "dynamic_sampling/groups_kept": float(self.groups - len(filled)),
                         "dynamic_sampling/filled_with_flat_groups": float(len(filled)),
                         "dynamic_sampling/extra_generation_s": extra_s, **self._dropped}
        if rounds == 1:  # no refill (on any process: rounds run in lockstep): the groups are TRL's batch's
            return out
        return merge(trainer, parts + filled, self.num_generations)  # a collective gather: every process merges

    def _sort(self, trainer, out: dict, parts: list, flat_pool: list, need: int) -> int:
        """Kept groups of one round's output into `parts` (up to `need`), flat ones into `flat_pool`; the need left."""
        rewards = trainer.round_rewards
        self.reward_range = [min(self.reward_range[0], float(rewards.nan_to_num(float("inf")).min())),
                             max(self.reward_range[1], float(rewards.nan_to_num(float("-inf")).max()))]
        rows = out["completion_ids"].size(0)
        mine = slice(trainer.accelerator.process_index * rows, (trainer.accelerator.process_index + 1) * rows)
        local = rewards[mine]
        # the test on every process's rewards, as frac_reward_zero_std is logged: one scale for the whole batch, so a
        # group dropped here is a group counted flat there
        groups = slice(mine.start // self.num_generations, mine.stop // self.num_generations)
        flat = flat_groups(rewards, self.num_generations)[groups].tolist()
        keep = [g for g, f in enumerate(flat) if not f][:need]
        if keep:
            parts.append((out, keep))
        mid = sum(self.reward_range) / 2
        for g, f in enumerate(flat):
            if f:
                flat_pool.append((out, [g]))
                value = float(local.view(-1, self.num_generations)[g].nan_to_num(float("-inf")).max())
                key = "dynamic_sampling/dropped_all_right" if value >= mid else "dynamic_sampling/dropped_all_wrong"
                self._dropped[key] += 1.0
        return need - len(keep)

    def _most_needed(self, trainer, need: int) -> int:
        """The most groups any process still lacks (every process samples that many: lockstep rounds)."""
        if trainer.accelerator.num_processes == 1:
            return need
        t = torch.tensor([need], device=trainer.accelerator.device)
        return int(trainer.accelerator.reduce(t, reduction="max").item())

    def _note_bound(self, rounds: int, filled: int) -> None:
        self.bound_streak = self.bound_streak + 1 if filled else 0
        if self.bound_streak >= BOUND_STREAK and not self.said_bound:
            self.said_bound = True
            right = self._dropped["dynamic_sampling/dropped_all_right"]
            wrong = self._dropped["dynamic_sampling/dropped_all_wrong"]
            which = "easy" if right >= wrong else "hard"
            log(f"dynamic sampling: {self.bound_streak} generation batches in a row used all {rounds} sampling rounds "
                f"without finding enough groups whose rewards differ (this batch: {int(right)} groups all right, "
                f"{int(wrong)} all wrong), so steps train partly on groups that teach nothing: the task is too {which} "
                f"for the model now. Fix: a {'harder' if which == 'easy' else 'easier'} task or curriculum, or raise "
                f"--max_sampling_rounds.")

    def metrics(self) -> dict:
        """The last filled batch's figures, once (a step that generated none logs none)."""
        out, self._metrics = self._metrics, {}
        return out

    def save(self, checkpoint_dir: str, is_main: bool) -> None:
        if is_main:
            os.makedirs(checkpoint_dir, exist_ok=True)
            with open(os.path.join(checkpoint_dir, STATE_FILE), "w") as f:
                json.dump({"prompts_taken": self.source.cursor, "reward_range": self.reward_range,
                           "bound_streak": self.bound_streak, "said_bound": self.said_bound}, f)

    def load(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, STATE_FILE)
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.source.cursor = int(state["prompts_taken"])
            self.reward_range = [float(v) for v in state["reward_range"]]
            self.bound_streak, self.said_bound = int(state["bound_streak"]), bool(state["said_bound"])


# TRL 1.16's output keys: padded on the left (prompt side), on the right (completion side), one value per row
_LEFT = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT = {"completion_ids": "pad", "completion_mask": 0, "old_per_token_logps": 0.0, "ref_per_token_logps": 0.0,
          "sampling_per_token_logps": 0.0, "importance_sampling_ratio": 1.0, "tool_mask": 0}
_ROWS = ("advantages",)


def merge(trainer, parts: list[tuple[dict, list[int]]], num_generations: int) -> dict:
    """One TRL output from the chosen groups of several: rows taken in order, each side padded to the longest real
    prompt / completion among them (TRL's pad_to_multiple_of kept), `num_items_in_batch` counted again (gathered)."""
    unknown = set(parts[0][0]) - set(_LEFT) - set(_RIGHT) - set(_ROWS) - {"num_items_in_batch"}
    if unknown:
        raise NotImplementedError(f"dynamic sampling cannot merge TRL outputs holding {sorted(unknown)}")
    rows = [torch.tensor([g * num_generations + i for g in groups for i in range(num_generations)],
                         device=out["completion_ids"].device) for out, groups in parts]
    prompt_len = max(int(out["prompt_mask"][r].sum(1).max()) for (out, _), r in zip(parts, rows))
    completion_len = max(int(out["completion_mask"][r].sum(1).max()) for (out, _), r in zip(parts, rows))
    multiple = trainer.args.pad_to_multiple_of
    if multiple:
        prompt_len, completion_len = (-(-n // multiple) * multiple for n in (prompt_len, completion_len))
    pad_id = trainer.processing_class.pad_token_id if hasattr(trainer.processing_class, "pad_token_id") \
        else trainer.processing_class.tokenizer.pad_token_id
    merged = {}
    for key in parts[0][0]:
        if key == "num_items_in_batch" or parts[0][0][key] is None:
            merged[key] = parts[0][0][key]
            continue
        pieces = [out[key][r] for (out, _), r in zip(parts, rows)]
        if key in _LEFT:
            value = pad_id if _LEFT[key] == "pad" else _LEFT[key]
            pieces = [_fit(p, prompt_len, value, left=True) for p in pieces]
        elif key in _RIGHT and pieces[0].dim() == 2 and pieces[0].size(1) > 1:  # (a sequence-level ratio is [B, 1])
            value = pad_id if _RIGHT[key] == "pad" else _RIGHT[key]
            pieces = [_fit(p, completion_len, value, left=False) for p in pieces]
        merged[key] = torch.cat(pieces)
    loss_mask = merged["completion_mask"] if merged.get("tool_mask") is None else \
        merged["completion_mask"] * merged["tool_mask"]
    merged["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    return merged


def _fit(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """t [rows, n] cut or padded with `value` to `width` columns on the padding side."""
    n = t.size(1)
    if n >= width:
        return t[:, n - width:] if left else t[:, :width]
    pad = t.new_full((t.size(0), width - n), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


__all__ = ["DynamicSampling", "PromptSource", "RTOL", "flat_groups", "merge"]
