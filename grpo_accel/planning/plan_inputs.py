"""plan_memory's inputs from a run: the one mapping from a run's fields or config object to what the planner reads.

A preset's plan (app/presets `Preset.plan_inputs`), the colocated engine's size (generation/vllm_setup.engine_config)
and continuous batching's page pool (trainer/paged_generation.planned_paged_seqs) call `plan_inputs`, each adding
what only it knows (the processes, the engine's sleep).
"""

from __future__ import annotations

from grpo_accel.core.settings import RunSettings, field_of

# plan_memory's arguments that are run settings as they run (core.settings.RunSettings fields, the same names)
PLANNED_SETTINGS = ("offload_activations", "offload_recompute_tokens", "offload_device_budget_bytes", "share_prompt",
                    "sequence_parallel_size", "logprob_impl", "logprob_chunk_size", "rollout_budget", "routing_replay",
                    "sampling_rounds")


def plan_inputs(source, *, model_dtype: str, quantization: str, lora_r: int, generation: str, max_prompt_length: int,
                cuda: bool, generation_batch: int | None = None) -> dict:
    """plan_memory's arguments that a run decides, from its fields or its config object (core.settings.field_of);
    our settings as core.settings.RunSettings resolves them on a machine with or without CUDA."""
    run = RunSettings.resolve(source, cuda=cuda)
    return dict(model_dtype=model_dtype, quantization=quantization, lora_r=lora_r,
                num_generations=field_of(source, "num_generations"), max_prompt_length=max_prompt_length,
                max_completion_length=field_of(source, "max_completion_length"),
                per_device_train_batch_size=field_of(source, "per_device_train_batch_size"),
                gradient_checkpointing=bool(field_of(source, "gradient_checkpointing", False)),
                **{name: getattr(run, name) for name in PLANNED_SETTINGS},
                generation=generation, generation_batch=generation_batch, device="cuda" if cuda else "cpu")


__all__ = ["PLANNED_SETTINGS", "plan_inputs"]
