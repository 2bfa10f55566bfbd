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


def planned_paged_seqs(trainer, prompt_tokens: int, generation_batch: int) -> int | None:
    """Full-length sequences the page pool holds at once: on CUDA the most the planner fits beside this run's
    training step on this GPU (planning.fitting.paged_sequences); elsewhere (CPU: host RAM) the whole batch (None)."""
    if torch.device(trainer.accelerator.device).type != "cuda":
        return None
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.fitting import paged_sequences
    from grpo_accel.planning.memory import plan_memory

    args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    lora = getattr(model, "peft_config", None)
    plan = plan_memory(model_shape(model.config), model_dtype=short_name(str(dtype).replace("torch.", "")),
                       quantization="4bit" if getattr(model, "is_loaded_in_4bit", False) else "none",
                       lora_r=int(next(iter(lora.values())).r) if lora else 0, num_generations=args.num_generations,
                       max_prompt_length=prompt_tokens, max_completion_length=args.max_completion_length,
                       per_device_train_batch_size=args.per_device_train_batch_size,
                       gradient_checkpointing=bool(args.gradient_checkpointing), generation="continuous_batching",
                       generation_batch=generation_batch, device="cuda",
                       offload_activations=bool(getattr(trainer, "offload_enabled", False)))
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
          as unwrapped, torch.no_grad(), trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False)):
        yield unwrapped
        unwrapped.train()


def paged_single_turn(trainer, prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
    """TRL's continuous-batching branch without the cast; see the module docstring."""
    user = dict(trainer.args.transformers_continuous_batching_config or {})
    prompt_tokens, batch = max(map(len, prompt_ids)), len(prompt_ids)
    with profiling_context(trainer, "transformers.generate_batch"), generation_context(trainer) as unwrapped:
        cfg, line = paged_config(unwrapped, generation_batch=batch, prompt_tokens=prompt_tokens,
                                 completion_tokens=trainer.args.max_completion_length,
                                 paged_seqs=planned_paged_seqs(trainer, prompt_tokens, batch), user=user)
        if getattr(trainer, "_paged_line", None) != line:  # once per size, not every step
            trainer._paged_line = line
            log(f"continuous batching: {line}")
        completion_ids = generate_paged(unwrapped, prompt_ids, trainer.generation_config, cfg)
    return completion_ids, None


__all__ = ["generation_context", "paged_single_turn", "planned_paged_seqs"]
