"""Run settings that several layers read, each defined once: its default and its "auto" rule (core/, so that the
planner, the offload, the trainer's config and the presets can all import it; docs: issue 37's settings layer).

    offload_activations_on("auto", cuda=True, gradient_checkpointing=True)   # True
"""

from __future__ import annotations

from grpo_accel.core.units import GIB

# Activation offload's re-run piece, in tokens: the backward re-runs a layer on row groups of at most this many
# tokens, and a longer row in sequence tiles of this many (OffloadConfig.recompute_tokens, the planner's
# recompute_tokens, --offload_recompute_tokens).
OFFLOAD_RECOMPUTE_TOKENS = 16384


def offload_activations_on(setting, cuda: bool, gradient_checkpointing: bool) -> bool:
    """--offload_activations: `true`/`false` as given (bools or strings); `auto`: on with CUDA and gradient
    checkpointing (offload only moves what checkpointing saves; on CPU the host is the device)."""
    if isinstance(setting, bool):
        return setting
    key = setting.strip().lower() if isinstance(setting, str) else None
    if key not in ("auto", "true", "false"):
        raise ValueError(f"activation offload must be True, False or 'auto', got {setting!r}")
    return bool(cuda and gradient_checkpointing) if key == "auto" else key == "true"


# --offload_device_budget_gib: layer inputs kept on the GPU, typed in GiB; the planner and the offload keep bytes.
# These two are the only conversions between them (the runner raises it from the planner's fit_host).
def device_budget_bytes(gib: float | None) -> int:
    return int((gib or 0) * GIB)


def device_budget_gib(nbytes: int) -> float:
    return nbytes / GIB


def generations_per_process(per_device_train_batch_size: int, steps_per_generation: int | None = None,
                            gradient_accumulation_steps: int | None = None, generation_batch_size: int | None = None,
                            processes: int = 1) -> int:
    """Sequences one process generates at once (the generation batch its KV cache or engine holds): TRL's
    per_device_train_batch_size x steps_per_generation (default gradient_accumulation_steps). A global
    generation_batch_size, before TRL resolves it (a preset planned on another machine), is that / processes."""
    if generation_batch_size:
        return -(-generation_batch_size // processes)
    return per_device_train_batch_size * (steps_per_generation or gradient_accumulation_steps or 1)


# --logprob_impl: TRL's head, our chunked one, the Triton kernel, or "auto" (Triton on CUDA, else chunked)
LOGPROB_IMPLS = ("trl", "chunked", "triton", "auto")


SHARE_PROMPT_MIN_SAVED = 0.25  # share_prompt="auto": share a group when it removes >= this share of its tokens


def shared_group_tokens(prompt_len: int, completion_lens: list[int]) -> int:
    """Tokens of one group in the shared-prompt layout (grpo_accel.parallel.shared_prompt): the prompt but its last
    token once, then each completion after a copy of that last token."""
    return prompt_len - 1 + sum(c + 1 for c in completion_lens)


def share_prompt_blocker(padding_free: bool, sequence_parallel_size: int) -> str | None:
    """Why the shared-prompt layout cannot run with these settings (None: it can): the config refuses
    --share_prompt true for it, "auto" turns off, the planner plans without it, the trainer and the runner say so."""
    if sequence_parallel_size > 1:
        return ("Ulysses shards each row along its length and a prompt shared by the group's rows would sit on one "
                "shard")
    if not padding_free:
        return "padding_free is off (the shared layout is a packed row)"
    return None


def share_prompt_pays(prompt_len: int, completion_lens: list[int], mode: str) -> bool:
    """Whether a group of rows with this prompt shares it: never for one row or a one-token prompt (nothing saved);
    "true": otherwise always; "auto": when it removes >= SHARE_PROMPT_MIN_SAVED of the group's tokens (a short
    prompt beside long completions stays on the packed path, where one attention call per row and no key copies
    cost least). The trainer decides per batch with this rule, the planner per run with the longest lengths."""
    if mode == "false" or len(completion_lens) < 2 or prompt_len < 2:
        return False
    unshared = sum(prompt_len + c for c in completion_lens)
    saved = unshared - shared_group_tokens(prompt_len, completion_lens)
    return mode == "true" or saved >= SHARE_PROMPT_MIN_SAVED * unshared


__all__ = ["LOGPROB_IMPLS", "OFFLOAD_RECOMPUTE_TOKENS", "SHARE_PROMPT_MIN_SAVED", "device_budget_bytes",
           "device_budget_gib", "generations_per_process", "offload_activations_on", "share_prompt_blocker",
           "share_prompt_pays", "shared_group_tokens"]
