"""Run settings that several layers read, each defined once: its default and its "auto" rule (core/, so that the
planner, the offload, the trainer's config and the presets can all import it; docs: issue 37's settings layer).

    offload_activations_on("auto", cuda=True, gradient_checkpointing=True)   # True
"""

from __future__ import annotations

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


__all__ = ["OFFLOAD_RECOMPUTE_TOKENS", "offload_activations_on"]
