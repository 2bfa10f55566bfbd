"""Where layer inputs live: on the device up to `OffloadConfig.device_budget_bytes`, in (pinned) host memory beyond,
never past `OffloadConfig.host_budget_bytes`; reloads land in device buffers from a reused pool.

Why a budget on the device: host memory, not the GPU, caps long rows (36 layers x 500K tokens x 4096 x 2 B = 147 GB
of inputs against 128 GiB on our GPU hosts); what the GPU has left after the step's working set is better spent
keeping the first layers' inputs than copying them (no PCIe traffic for those, the same peak as long as the
budget is planned). Why a host limit: pinned memory past what the host has swaps or kills the process with no
message; the stash raises `HostMemoryError` naming the fix instead. Why a pool: a buffer allocated on the copy
stream belongs to that stream in the caching allocator, so the compute stream never reuses it and reserved memory
grows past allocated (12 GiB above it on the H100 offload step); pool buffers are allocated on the compute stream
and handed back after the layer's re-run, two of them for the double buffer.
"""

from __future__ import annotations

import os

import torch

from grpo_accel.core.errors import UserError
from grpo_accel.core.phase_memory import proc_field_bytes
from grpo_accel.core.processes import local_processes
from grpo_accel.core.units import GIB


class HostMemoryError(UserError, ValueError):
    """Offloaded activations would not fit in host memory. The message names the fix."""


def meminfo_bytes(key: str) -> int | None:
    """A /proc/meminfo field in bytes ("MemAvailable", "MemTotal"), None where it cannot be read."""
    return proc_field_bytes("/proc/meminfo", key)


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else None."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def host_block_bytes(nbytes: int, pinned: bool) -> int:
    """Host memory one copy of `nbytes` holds: torch's CachingHostAllocator rounds every pinned block up to a power
    of two (ATen/core/CachingHostAllocator.h, PowerOf2Ceil; a 2.3 GiB layer input holds 4 GiB), pageable copies
    hold their bytes. The host budget counts blocks, or it passes what the OOM killer then stops (issue 35)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 1 else nbytes


def host_budget_per_process(fraction: float = 0.9) -> int | None:
    """This process's share of what the host has free now: `fraction` of MemAvailable over the processes of this
    machine (each stashes up to its own budget, so k processes together stay within the node's), None if unknown."""
    available = host_available_bytes()
    return None if available is None else int(fraction * available) // local_processes()


def host_error(need_bytes: int, have_bytes: int, what: str = "offloaded layer inputs") -> HostMemoryError:
    return HostMemoryError(
        f"{what} need {need_bytes / GIB:.1f} GiB of host memory, this host has {have_bytes / GIB:.1f} GiB for them: "
        "lower max_completion_length (grpo-accel plan --find-max-t prints the longest that fits), keep more layer "
        "inputs on the GPU (a larger offload device budget), lower per_device_train_batch_size, or use a host with "
        "more memory")


def check_host_memory(need_bytes: int, have_bytes: int | None = None, reserve_fraction: float = 0.1) -> None:
    """Raise HostMemoryError when `need_bytes` of host memory exceed (1 - reserve_fraction) of `have_bytes`
    (default: what the host has available now). Call it before the weights load, from the plan's host terms."""
    have = host_available_bytes() if have_bytes is None else have_bytes
    if have is not None and need_bytes > (1 - reserve_fraction) * have:
        raise host_error(need_bytes, int((1 - reserve_fraction) * have))


class BufferPool:
    """Device buffers for reloaded inputs, keyed by (shape, stride, dtype, device); at most `per_key` kept free."""

    def __init__(self, per_key: int = 2):
        self.per_key, self.free, self.allocated = per_key, {}, 0

    @staticmethod
    def _key(t: torch.Tensor, device) -> tuple:
        return tuple(t.shape), t.stride(), t.dtype, torch.device(device)

    def take(self, like: torch.Tensor, device) -> tuple[torch.Tensor, object]:
        """(buffer, event to wait for before writing it, or None). Allocated on the current stream when new."""
        free = self.free.get(self._key(like, device))
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device), None

    def give(self, t: torch.Tensor) -> None:
        """Back to the pool once the current stream's work on it is queued (the next writer waits for that)."""
        free = self.free.setdefault(self._key(t, t.device), [])
        if len(free) < self.per_key:
            ev = None
            if t.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
            free.append((t, ev))

    @property
    def free_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for free in self.free.values() for t, _ in free)
