"""What to offload and how: `OffloadConfig` (whether to offload at all is a run setting: core.settings.RunSettings)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_accel.core.settings import OFFLOAD_RECOMPUTE_TOKENS


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
    def from_settings(cls, settings, host_budget_bytes: int | None = None, **overrides) -> OffloadConfig:
        """The stash a run's settings ask for (core.settings.RunSettings, the planner's inputs too): its re-run
        piece and device budget; `host_budget_bytes` caps the host side (what the host has free): a wrong plan stops
        with HostMemoryError, not the OOM killer."""
        return cls(recompute_tokens=settings.offload_recompute_tokens,
                   device_budget_bytes=settings.offload_device_budget_bytes, host_budget_bytes=host_budget_bytes,
                   **overrides)
