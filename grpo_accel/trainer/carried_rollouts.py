"""`--rollout_budget N` in TRL's step: each step decodes in rounds of at most N tokens per completion, trains on the
first complete groups, and carries the rest into the next step (issue 53; the scheduler is
generation/rollout_budget.py, the record generation/rollouts.py, the design docs/off-policy-rollouts.md).

How it sits in TRL 1.16's `_generate_and_score_completions(inputs)` (the design's two steps):
1. `generate_and_score`: the next generation batch's prompts (read one optimizer step early, as server mode reads
   them: generation_modes.ReadAhead) join the rollouts in flight as new groups beside this batch's, which joined a step
   ago; the rounds run until this step's number of groups are complete, and TRL's method continues with **the ready
   groups' own dataset rows** (a carried group's rewards read its row, not the batch's). Starting the next batch
   early is what gives a step more groups than it trains: with only its own batch in flight, a step would have to
   finish every group of it, the longest completion included. At most two batches are in flight.
2. `carried_single_turn` (TRL's `_generate_single_turn`): hands TRL the ready groups' tokens and, per token, the
   behaviour log-prob where an older policy sampled it. A token this step's policy sampled gets NaN, which TRL's
   correction reads as "no correction" (ratio exactly 1): the sampler of those tokens is the trained policy itself,
   as on the synchronous route, so a step without carried tokens is the synchronous step.

TRL applies its importance-sampling correction only where `trainer.use_vllm` is true (docs/off-policy-rollouts.md
lists the reads, tests/test_rollouts.py pins them), so the trainer reads `use_vllm = True` while a budget is on; its
generation never reaches TRL's vLLM branch (`_generate_single_turn` is ours). An evaluation decodes as without a
budget (one round at the completion limit, nothing carried), every token on-policy.

Routes. Continuous batching (transformers' continuous batching returns each token's log-prob after temperature and
top-k/top-p): inside a step a continued completion gets its full pages back from transformers' prefix cache, carried
into the next step it is prefilled again (prompt + partial completion) under the new weights. Colocated vLLM
(`SharedVLLMGeneration.rounds`): one engine request per completion for a step's rounds, aborted at the step's end and
resubmitted (prompt + partial completion) after the next sync, the adapter synced once per step as TRL syncs it;
every token TRL gets carries the engine's behaviour log-prob, as on TRL's own vLLM route (the engine is another copy
of the policy: its tokens are corrected for even when this step's adapter sampled them). `generate()` cannot pause
a completion: it says so in one line and runs as without a budget. A vLLM server samples ahead on its own
(server_mode.py, max_staleness): it refuses the flag.
Checkpoints hold each rank's rollouts in flight (`rollouts-rank<k>.json`): a resume continues them.
"""

from __future__ import annotations

import json
import math
import os

from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError
from grpo_accel.generation.continuous_batching import ROUND_PAGE_SIZE, paged_decode
from grpo_accel.generation.rollout_budget import BudgetedRollouts
from grpo_accel.trainer.generation_modes import (
    ColocatedVLLMMode,
    GenerationMode,
    ReadAhead,
    refuse_multi_turn,
    sync_once_per_step,
)
from grpo_accel.trainer.paged_generation import (
    ContinuousBatchingMode,
    generation_context,
    keep_routing,
    planned_paged_seqs,
    routing_capture,
)


class BudgetMode(GenerationMode):
    """--rollout_budget over the route under it (continuous batching or colocated vLLM): the rollouts in flight
    (`rollouts`), the groups this step trains while TRL scores them (`carried`: (version, groups)), the next batch's
    rows read one step early (`read_ahead`)."""

    def __init__(self, trainer, base: GenerationMode):
        args = trainer.args
        self.engine_rounds = isinstance(base, ColocatedVLLMMode)  # every token's engine log-prob goes to TRL
        self.rollouts = BudgetedRollouts(trainer.num_generations, args.rollout_budget, args.max_completion_length,
                                         args.max_staleness)
        self.read_ahead = ReadAhead()
        self.carried = None
        self.routing_blocker = base.routing_blocker  # the rounds run on `base`'s producer
        trainer.use_vllm = True  # TRL's correction gates (see the module docstring); generation stays ours
        log(f"rollout_budget: rounds of {args.rollout_budget} tokens per completion; completions still running when "
            f"a step has its groups are carried into the next (max_staleness {args.max_staleness}, TRL's importance-"
            "sampling correction on the older tokens)")

    @classmethod
    def over(cls, trainer, base: GenerationMode) -> GenerationMode:
        """The budget over `base`, after TRL's __init__; `base` itself, with one line, where it cannot pause a
        completion (generate()); refused where it cannot run."""
        args = trainer.args
        if trainer.use_vllm and not isinstance(base, ColocatedVLLMMode):
            raise ConfigError(f"--rollout_budget {args.rollout_budget} pauses completions on the trainer's own routes "
                              "(continuous batching, colocated vLLM); a vLLM server already samples ahead of the step "
                              "(--max_staleness). Fix: --rollout_budget 0 with --vllm_mode server, or --vllm_mode "
                              "colocate.")
        if not isinstance(base, (ColocatedVLLMMode, ContinuousBatchingMode)):
            log(f"rollout_budget {args.rollout_budget}: route generate cannot pause a completion (transformers' "
                "generate() decodes a batch to its end), so every step runs without a budget; "
                "--use_transformers_continuous_batching true pauses them")
            return base
        if not args.vllm_importance_sampling_correction:
            raise ConfigError("--rollout_budget trains on tokens an older policy sampled: it needs TRL's importance-"
                              "sampling correction. Fix: --vllm_importance_sampling_correction true, or "
                              "--rollout_budget 0.")
        refuse_multi_turn(trainer, "--rollout_budget", " yet (completions decoded in rounds by the trainer's own "
                          "route)", "--rollout_budget 0", ("sequence parallelism", args.sequence_parallel_size > 1))
        rows = args.per_device_train_batch_size * args.steps_per_generation
        if rows % trainer.num_generations:
            raise ConfigError(f"--rollout_budget carries whole groups per process: this process's generation batch "
                              f"({rows} rows) must hold whole groups of num_generations={trainer.num_generations}. "
                              "Fix: per_device_train_batch_size x steps_per_generation a multiple of "
                              "num_generations.")
        return cls(trainer, base)

    def _decoder(self, trainer, unwrapped, sequences: int, prompt_tokens: int, capture=None):
        """The step's manager, its pool sized as the unbudgeted route's: on CUDA the most of the `sequences` in
        flight (both batches) that fit beside training (planned_paged_seqs), the rest queued in transformers'; on CPU
        all."""
        from grpo_accel.generation.continuous_batching import paged_config

        batch = max(sequences, 1)
        cfg, _ = paged_config(unwrapped, generation_batch=batch, prompt_tokens=prompt_tokens,
                              completion_tokens=trainer.args.max_completion_length, page_size=ROUND_PAGE_SIZE,
                              paged_seqs=planned_paged_seqs(trainer, prompt_tokens, batch),
                              user=dict(trainer.args.transformers_continuous_batching_config or {}))
        return paged_decode(unwrapped, trainer.generation_config, cfg, capture=capture)

    def generate_and_score(self, trainer, inputs: list[dict], score):
        """TRL's `_generate_and_score_completions` (`score`) on the groups this step trains (module docstring)."""
        G, rollouts = trainer.num_generations, self.rollouts
        unique = inputs[::G]
        prompt_ids, _, _ = trainer._tokenize_prompts([x["prompt"] for x in unique])
        if prompt_ids != rollouts.ahead:  # admitted a step ago as the batch ahead; else (the first step, after an
            rollouts.add_prompts(prompt_ids, unique)  # epoch's end) now
        ahead_rows = self.read_ahead.take_next_rows()
        rollouts.ahead = None
        if ahead_rows is not None:  # None at an epoch's last batch: nothing is started ahead across it
            ahead = ahead_rows[::G]
            rollouts.ahead, _, _ = trainer._tokenize_prompts([x["prompt"] for x in ahead])
            rollouts.add_prompts(rollouts.ahead, ahead)
        return self._step_and_score(trainer, len(unique), score)

    def refill_and_score(self, trainer, inputs: list[dict], score):
        """Dynamic sampling's refill round (dynamic_sampling.py): its prompts join the groups in flight and the
        round trains the first complete ones, oldest first, as a step does, so groups already sampled (the batch
        started ahead, completions carried) come before the new prompts; the batch read ahead stays admitted."""
        unique = inputs[::trainer.num_generations]
        prompt_ids, _, _ = trainer._tokenize_prompts([x["prompt"] for x in unique])
        self.rollouts.add_prompts(prompt_ids, unique)
        return self._step_and_score(trainer, len(unique), score)

    def _step_and_score(self, trainer, n_groups: int, score):
        """The rounds until `n_groups` groups are complete, then TRL's method on their rows."""
        G, rollouts = trainer.num_generations, self.rollouts
        version = trainer.state.global_step
        # the rounds are this step's generation (time/generation_s)
        with trainer._phase("generation"):
            if self.engine_rounds:
                sync_once_per_step(trainer)
                with trainer.vllm_generation.rounds() as decode:
                    ready, dropped = rollouts.step(n_groups, version, decode)
            else:  # the page pool for the sequences in flight, at the longest prompt
                running = sum(1 for g in rollouts.buffer.groups for r in g.rollouts if not r.finished)
                longest = max(len(g.prompt_ids) for g in rollouts.buffer.groups)
                with generation_context(trainer) as unwrapped, \
                        self._decoder(trainer, unwrapped, running, longest, routing_capture(trainer)) as decode:
                    ready, dropped = rollouts.step(n_groups, version, decode)
        if dropped:
            log(f"rollout_budget: step {version} dropped {len(dropped)} group(s) past max_staleness "
                f"{rollouts.buffer.max_staleness}")
        self.carried = (version, ready)
        try:
            return score([dict(g.inputs) for g in ready for _ in range(G)])
        finally:
            self.carried = None

    def single_turn(self, trainer, prompt_ids) -> tuple[list[list[int]], list[list[float]]] | None:
        """TRL's `_generate_single_turn` while a budget is on: the ready groups (training), or one unbudgeted round
        (evaluation; None on colocated vLLM: TRL's own vLLM generation serves it)."""
        if self.carried is None:  # evaluation: every token from this policy, nothing carried
            if self.engine_rounds:
                return None
            with generation_context(trainer) as unwrapped, \
                    self._decoder(trainer, unwrapped, len(prompt_ids), max(map(len, prompt_ids))) as decode:
                out = decode([list(p) for p in prompt_ids], [trainer.args.max_completion_length] * len(prompt_ids))
            return [ids for ids, _, _ in out], [[math.nan] * len(ids) for ids, _, _ in out]
        version, ready = self.carried
        rows = [(g.prompt_ids, r) for g in ready for r in g.rollouts]
        if [list(p) for p in prompt_ids] != [p for p, _ in rows]:
            raise RuntimeError("TRL tokenized the carried groups' rows into other prompts than they were sampled from")
        engine = self.engine_rounds
        logps = [[lp if engine or v < version else math.nan for lp, v in zip(r.behaviour_logps, r.versions)]
                 for _, r in rows]
        if getattr(trainer, "routing_records", None) is not None and self.routing_blocker is None:
            keep_routing(trainer, [p + r.completion_ids for p, r in rows], [r.routed_experts for _, r in rows])
        return [list(r.completion_ids) for _, r in rows], logps

    def save(self, trainer, checkpoint_dir: str) -> None:
        save_rollouts(trainer, self.rollouts, checkpoint_dir)

    def load(self, trainer, checkpoint_dir: str) -> None:
        load_rollouts(trainer, self.rollouts, checkpoint_dir)

    def metrics(self) -> dict:
        return self.rollouts.metrics()


def rollouts_file(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"rollouts-rank{rank}.json")


def save_rollouts(trainer, rollouts: BudgetedRollouts, checkpoint_dir: str) -> None:
    """Each rank's rollouts in flight into the checkpoint, every rank's written before any returns: rank 0 writes
    trainer_state.json, which completes the checkpoint (trainer/checkpoints.py), after this. Without the barrier a
    SIGKILL between them leaves a checkpoint `latest` resumes from and rank k finds no rollouts in (transformers'
    store_flos all-gather also orders them today, by accident: tests/test_budget_sigkill.py checks the order with it
    taken out)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = rollouts_file(checkpoint_dir, trainer.accelerator.process_index)
    with open(path + ".tmp", "w") as f:
        json.dump(rollouts.state_dict(), f)
    os.replace(path + ".tmp", path)
    trainer.accelerator.wait_for_everyone()


def load_rollouts(trainer, rollouts: BudgetedRollouts, checkpoint_dir: str) -> None:
    path = rollouts_file(checkpoint_dir, trainer.accelerator.process_index)
    if not os.path.exists(path):
        raise ConfigError(f"{checkpoint_dir} holds no rollouts for rank {trainer.accelerator.process_index} "
                          "(saved without --rollout_budget, or by another number of processes). Fix: resume with "
                          "the flags and processes it was saved with.")
    with open(path) as f:
        rollouts.load_state_dict(json.load(f))


__all__ = ["BudgetMode", "load_rollouts", "save_rollouts"]
