"""Measured memory: the peak of named, possibly nested phases of a run (generate, logprobs, backward, optimizer, ...)
and this process's RSS. CUDA: torch's max_memory_allocated / reserved; CPU: peak RSS (VmHWM, reset per phase).
What the planner predicts for the same step: memory.py."""

from __future__ import annotations

import dataclasses
import resource
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from grpo_accel.core.units import GIB


def proc_field_bytes(path: str, key: str) -> int | None:
    """A kB field of a /proc file in bytes ("VmRSS" of /proc/self/status, "MemAvailable" of /proc/meminfo), None
    where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def proc_status_bytes(key: str) -> int | None:
    return proc_field_bytes("/proc/self/status", key)


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        rss = proc_status_bytes("VmRSS")
        return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process: Linux >= 4.0, `echo 5 > clear_refs`."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return proc_status_bytes("VmHWM") is not None
    except OSError:
        return False


@dataclass
class PhaseRecord:
    name: str
    peak_bytes: int  # CUDA: max_memory_allocated; CPU: peak RSS of the process
    start_bytes: int
    end_bytes: int
    seconds: float
    reserved_bytes: int | None = None  # CUDA: max_memory_reserved over the phase (None on CPU)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


class PhaseMemory:
    """Records the peak memory of named, possibly nested, phases.

        mem = PhaseMemory()                      # CUDA when available, else host RSS
        with mem.phase("generate"): ...
        with mem.phase("backward"): ...
        mem.peaks_gib()                          # {"generate": 21.3, "backward": 64.0}, max over repeats

    CUDA: torch.cuda.reset_peak_memory_stats at each phase start, max_memory_allocated at its end.
    CPU: the kernel's VmHWM, reset per phase through /proc/self/clear_refs; where that is not allowed, a
    background thread samples the RSS every `interval_s` (may miss peaks shorter than that).
    Nested phases: a parent's peak includes its children's (read before each reset, merged after).
    """

    def __init__(self, device: str | None = None, interval_s: float = 0.005):
        import torch

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.interval_s = interval_s
        self.records: list[PhaseRecord] = []
        self._stack: list[list] = []  # [name, running_peak, start_bytes, t0]
        self._hwm = self.device == "cpu" and reset_peak_rss()
        self._sampler = None

    # one backend: current bytes, peak since last reset, reset
    def _current(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.device.startswith("cuda") else rss_bytes()

    def _peak(self) -> int:
        import torch

        if self.device.startswith("cuda"):
            return torch.cuda.max_memory_allocated()
        if self._hwm:
            return proc_status_bytes("VmHWM") or 0
        return max(self._sampled_peak, rss_bytes())

    def _reserved_peak(self) -> int | None:
        import torch

        # reset_peak_memory_stats resets the reserved peak too: nested phases read it since their own start
        return torch.cuda.max_memory_reserved() if self.device.startswith("cuda") else None

    def _reset(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        elif self._hwm:
            reset_peak_rss()
        else:
            self._sampled_peak = rss_bytes()

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            self._sampled_peak = max(self._sampled_peak, rss_bytes())

    @contextmanager
    def phase(self, name: str):
        if self._stack:  # keep what the parent has seen so far before resetting the counter
            self._stack[-1][1] = max(self._stack[-1][1], self._peak())
        elif not self._hwm and not self.device.startswith("cuda"):
            stop = threading.Event()
            self._sampled_peak = rss_bytes()
            self._sampler = (stop, threading.Thread(target=self._sample, args=(stop,), daemon=True))
            self._sampler[1].start()
        self._reset()
        frame = [name, 0, self._current(), time.perf_counter()]
        self._stack.append(frame)
        try:
            yield self
        finally:
            self._stack.pop()
            peak = max(frame[1], self._peak())
            reserved = self._reserved_peak()
            self.records.append(PhaseRecord(name, int(peak), frame[2], self._current(),
                                            time.perf_counter() - frame[3], reserved))
            if self._stack:
                self._stack[-1][1] = max(self._stack[-1][1], peak)
            elif self._sampler is not None:
                self._sampler[0].set()
                self._sampler[1].join()
                self._sampler = None

    def peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.name] = max(out.get(r.name, 0), r.peak_bytes)
        return out

    def peaks_gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in self.peaks().items()}

    def metrics(self, prefix: str = "memory/") -> dict[str, float]:
        """Flat dict for trackers: {"memory/generate_peak_gib": ...}; on CUDA also the caching allocator's
        reserved peak per phase ({"memory/generate_reserved_gib": ...}): what the GPU really had to hold."""
        out = {f"{prefix}{k}_peak_gib": v for k, v in self.peaks_gib().items()}
        for r in self.records:
            if r.reserved_bytes is not None:
                key = f"{prefix}{r.name}_reserved_gib"
                out[key] = max(out.get(key, 0.0), round(r.reserved_bytes / GIB, 3))
        return out

    def as_records(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (ru_maxrss is KiB on Linux)."""
    hwm = proc_status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


__all__ = ["PhaseMemory", "PhaseRecord", "peak_rss_bytes", "proc_field_bytes", "proc_status_bytes", "reset_peak_rss",
           "rss_bytes"]
