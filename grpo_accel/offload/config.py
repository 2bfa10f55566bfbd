"""What to offload and how: `OffloadConfig`, and `resolve_offload` for the user-facing on/off/"auto" setting."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_accel.core.settings import OFFLOAD_RECOMPUTE_TOKENS, offload_activations_on


@dataclass(frozen=True)
class OffloadConfig:
    """Where saved tensors go. `None` fields mean "decide per tensor": copy, pin and use a side
    stream only for tensors on CUDA. `device_copies=True` copies CPU tensors too (into a distinct
    host storage), which is how the CPU tests run the real stash/copy/restore path."""

    device_copies: bool | None = None
    use_streams: bool | None = None
    pin_memory: bool | None = None
    min_bytes: int = 1 << 20  # smaller tensors stay on the device: a copy costs more than it saves
    prefetch: bool = True
    # Backward re-runs a layer on row groups of at most this many tokens (>= 1 row), one group at a time, so the
    # re-run's saved tensors exist for one group only: rows are independent sequences through a decoder layer
    # (attention is per row), so the FLOPs are the same. Llama-3.1-8B, G=8, T=8192: one layer's re-run saves
    # ~15 GB for the whole batch. None = the whole batch at once. See `_row_groups` for when it stays whole.
    # A row longer than this runs in sequence tiles of this many tokens (tiling/layer.py), forward and re-run.
    recompute_tokens: int | None = OFFLOAD_RECOMPUTE_TOKENS
    # Residency (residency.py): layer inputs stay on the device while those kept there total <= this many bytes,
    # the rest go to host memory; 0 = all but the newest go. The planner sizes it from what the step leaves free.
    device_budget_bytes: int = 0
    # Host bytes the stash may hold (None = unchecked); past it the stash raises HostMemoryError naming the fix.
    host_budget_bytes: int | None = None

    @classmethod
    def from_plan(cls, plan, host_budget_bytes: int | None = None, **overrides) -> OffloadConfig:
        """The stash settings a grpo_accel.planning.memory plan assumed: its piece size (recompute_tokens) and device
        budget (offload_device_budget_bytes, e.g. chosen by memory.fit_host); `host_budget_bytes` caps the host
        side (what the start-up check found available): a wrong plan stops with HostMemoryError, not the OOM killer."""
        inp = plan.inputs
        return cls(recompute_tokens=inp.get("recompute_tokens", cls.recompute_tokens),
                   device_budget_bytes=int(inp.get("offload_device_budget_bytes", 0)),
                   host_budget_bytes=host_budget_bytes, **overrides)


def resolve_offload(setting: bool | str, device: torch.device | str, gradient_checkpointing: bool = True) -> bool:
    """`True`/`False` as given (also as strings); `"auto"`: on when `device` is CUDA and gradient
    checkpointing is on (core.settings.offload_activations_on: the one rule, the planner's too)."""
    return offload_activations_on(setting, torch.device(device).type == "cuda", gradient_checkpointing)

