"""TRL's `use_transformers_continuous_batching` branch of `_generate_single_turn`, done without its in-place cast:
the route `continuous_batching` (generation/continuous_batching.py says why and how), in TRL's own context (its
unwrap for generation, DeepSpeed-3 gather, FSDP summon), sized by the planner.

TRL 1.16's branch: `unwrapped_model.to(torch.bfloat16)` (bf16 runs) before `generate_batch`, then no log-probs.
Ours: the same context and call, the weights as they are, `num_blocks` from the plan, packing's attention stepped
aside; returns `(completion_ids, None)` as TRL's does (no behaviour log-probs: the sampler is the trained policy).
"""

from __future__ import annotations

import contextlib

import torch
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from grpo_accel.core.console import log
from grpo_accel.core.dtypes import short_name
from grpo_accel.generation.continuous_batching import generate_paged, paged_config
from grpo_accel.generation.routing_capture import RoutingCapture
from grpo_accel.trainer.generation_modes import GenerationMode


def planned_paged_seqs(trainer, prompt_tokens: int, generation_batch: int) -> int | None:
    """Full-length sequences the page pool holds at once: on CUDA the most the planner fits beside this run's
    training step on this GPU (planning.fitting.paged_sequences); elsewhere (CPU: host RAM) the whole batch (None)."""
    if torch.device(trainer.accelerator.device).type != "cuda":
        return None
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.fitting import paged_sequences
    from grpo_accel.planning.memory import plan_memory
    from grpo_accel.planning.plan_inputs import plan_inputs

    args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    lora = getattr(model, "peft_config", None)
    plan = plan_memory(model_shape(model.config), **plan_inputs(
        args, model_dtype=short_name(str(dtype).replace("torch.", "")),
        quantization="4bit" if getattr(model, "is_loaded_in_4bit", False) else "none",
        lora_r=int(next(iter(lora.values())).r) if lora else 0, generation="continuous_batching",
        max_prompt_length=prompt_tokens, cuda=True, generation_batch=generation_batch))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return max(1, paged_sequences(plan, total))


@contextlib.contextmanager
def generation_context(trainer):
    """TRL's context for generating with the trained weights (its unwrap for generation, DeepSpeed-3 gather,
    gradient checkpointing off; no grad; FSDP's full parameters): the unwrapped model, put back in train mode at the
    end. The route's own generation and --rollout_budget's rounds (carried_rollouts.py) both run in it."""
    with (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                      gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                      gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
          as unwrapped, zero3_forward_start_paused(trainer.model_wrapped), torch.no_grad(),
          trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False)):
        yield unwrapped
        unwrapped.train()


@contextlib.contextmanager
def zero3_forward_start_paused(engine):
    """Inside: DeepSpeed ZeRO-3's start-of-forward hook is off (a no-op elsewhere).

    Why: TRL's unwrap for generation gathers the weights and removes ZeRO-3's per-module hooks, but not the hook on
    the top module that calls the parameter coordinator's `reset_step` before every forward, and `reset_step` runs a
    collective (`assert_ints_same_as_other_ranks`) while the coordinator's trace is incomplete, which it is after
    each generation (TRL's add_hooks invalidates it). transformers' generate() keeps ranks in step (`synced_gpus`);
    continuous batching does not: a rank whose completions end sooner runs fewer forwards, and the other waits in
    that collective for good (a 2-rank ZeRO-3 launch with a rollout budget hung at its 4th step:
    tests/test_budget_sigkill.py). The generation forwards read the gathered weights and record no trace, so the hook
    has nothing to do there; it goes back, in its place, before TRL re-registers the module hooks."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    handle = getattr(offload, "fwd_pre_hook", None)
    hooks = getattr(getattr(offload, "module", None), "_forward_pre_hooks", None)
    hook = hooks.pop(handle.id, None) if handle is not None and hooks is not None else None
    try:
        yield
    finally:
        if hook is not None:
            hooks[handle.id] = hook
            hooks.move_to_end(handle.id, last=False)  # first, as DeepSpeed registered it


def routing_capture(trainer) -> RoutingCapture | None:
    """A recorder of the sampler's MoE routing while training with --routing_replay on a MoE (None otherwise: an
    evaluation's completions train nothing)."""
    replay = getattr(trainer, "routing_replay", None)
    return RoutingCapture(replay) if replay is not None and trainer.model.training else None


def keep_routing(trainer, sequences: list[list[int]], routing: list) -> None:
    """The generation batch's recorded routing, each sequence's (prompt + completion tokens) under its tokens, in
    place of the last batch's: what the log-prob passes replay (RoutingRecords)."""
    trainer.routing_records.replace({tuple(seq): r for seq, r in zip(sequences, routing) if r is not None})


class ContinuousBatchingMode(GenerationMode):
    """The route continuous_batching: TRL's `use_transformers_continuous_batching` branch without its cast (module
    docstring); `line`: the pool's sizing, said once per size. Records the sampler's MoE routing
    (routing_capture.py) for --routing_replay."""

    routing_blocker = None

    def __init__(self):
        self.line = None

    def single_turn(self, trainer, prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
        user = dict(trainer.args.transformers_continuous_batching_config or {})
        prompt_tokens, batch = max(map(len, prompt_ids)), len(prompt_ids)
        with profiling_context(trainer, "transformers.generate_batch"), generation_context(trainer) as unwrapped:
            cfg, line = paged_config(unwrapped, generation_batch=batch, prompt_tokens=prompt_tokens,
                                     completion_tokens=trainer.args.max_completion_length,
                                     paged_seqs=planned_paged_seqs(trainer, prompt_tokens, batch), user=user)
            if self.line != line:  # once per size, not every step
                self.line = line
                log(f"continuous batching: {line}")
            capture = routing_capture(trainer)
            completion_ids = generate_paged(unwrapped, prompt_ids, trainer.generation_config, cfg, capture=capture)
        if capture is not None:
            keep_routing(trainer, [p + c for p, c in zip(prompt_ids, completion_ids)], capture.last)
        return completion_ids, None


__all__ = ["ContinuousBatchingMode", "generation_context", "keep_routing", "planned_paged_seqs", "routing_capture",
           "zero3_forward_start_paused"]
