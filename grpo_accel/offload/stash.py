"""The stash: each checkpointed call's saved inputs, copied to host memory on a side stream and brought back one
layer ahead of need in backward (double buffer). `StashEntry` is one call's inputs; `ActivationStash` orders them."""

from __future__ import annotations

import contextlib
import weakref

import torch

from grpo_accel.offload import tracker as _tracker
from grpo_accel.offload.config import OffloadConfig
from grpo_accel.offload.residency import BufferPool, host_block_bytes, host_error
from grpo_accel.offload.tracker import tensor_nbytes

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return _STREAMS[device] if device in _STREAMS else _STREAMS.setdefault(device, torch.cuda.Stream(device))


def offload_policy(t: torch.Tensor, cfg: OffloadConfig, min_bytes: int) -> tuple[bool, bool, bool]:
    """(copy to host?, pin?, side stream?) for one tensor."""
    on_device = t.device.type != "cpu" if cfg.device_copies is None else cfg.device_copies
    copy = on_device and tensor_nbytes(t) >= min_bytes
    pin = (t.is_cuda if cfg.pin_memory is None else cfg.pin_memory) and torch.cuda.is_available()
    return copy, pin, t.is_cuda and cfg.use_streams is not False


def _copy(src: torch.Tensor, device, pin: bool, stream) -> torch.Tensor:
    """Async copy (non_blocking when the host side is pinned), queued on `stream` when given."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return torch.empty_like(src, device=device, pin_memory=pin and device == "cpu").copy_(src, non_blocking=pin)


class StashEntry:
    """The saved inputs of one checkpointed call; owned by its autograd ctx, indexed weakly by the
    stash. Per tensor: `dev[i]` (original or reloaded copy), `host[i]` (host copy), `policy[i]`."""

    def __init__(self, tensors, cfg: OffloadConfig, min_bytes: int | None = None, stash=None):
        self.stash = stash  # host budget and buffer pool (None for the head's saved tensors: unchecked, unpooled)
        self.dev = [t.detach() for t in tensors]
        self.pooled = [False] * len(tensors)
        self.held_host = 0  # host bytes counted against the stash's budget for this entry
        self.resident = False  # kept on the device under the stash's device budget
        self.host = [None] * len(tensors)
        self.versions = [t._version for t in tensors]
        self.policy = [offload_policy(t, cfg, cfg.min_bytes if min_bytes is None else min_bytes) for t in tensors]
        self.device = [t.device for t in tensors]
        self.tracker = _tracker._TRACKERS[-1] if _tracker._TRACKERS else None
        self.events: dict[str, torch.cuda.Event] = {}
        self.loaded = False
        cuda = [d for d, p in zip(self.device, self.policy) if p[2]]
        if cuda:  # the inputs' ready point, so their D2H need not wait for the layer that reads them
            self.events["ready"] = torch.cuda.Event()
            self.events["ready"].record(torch.cuda.current_stream(cuda[0]))
        self._report(sum(map(tensor_nbytes, tensors)), "device")

    def device_bytes(self) -> int:
        """Bytes of this entry's copyable inputs that are on the device now."""
        return sum(tensor_nbytes(t) for t, p, h in zip(self.dev, self.policy, self.host) if p[0] and t is not None
                   and h is None)

    def _report(self, nbytes: int, where: str) -> None:
        if self.tracker is not None and nbytes:
            self.tracker.add(nbytes, where)

    def _check_version(self, i: int) -> None:
        if self.host[i] is None and self.dev[i]._version != self.versions[i]:
            raise RuntimeError("an input of an offloaded checkpoint was modified in place after the "
                               "forward; clone it before modifying (as torch.utils.checkpoint requires)")

    def offload(self) -> None:
        """Queue the D2H copies; the device memory goes back to the allocator once they have run."""
        for i, (copy, pin, streams) in enumerate(self.policy):
            if copy and self.host[i] is None:
                self._check_version(i)
                t, side = self.dev[i], _side_stream(self.device[i]) if streams else None
                if self.stash is not None:  # the pinned allocator's block, not the tensor's bytes
                    self.held_host += self.stash.reserve_host(host_block_bytes(tensor_nbytes(t), pin))
                if side is not None:
                    side.wait_event(self.events["ready"])
                self.host[i] = _copy(t, "cpu", pin, side)
                if side is not None:
                    t.record_stream(side)  # the caching allocator must not reuse t before the copy ran
                self.dev[i] = None
                self._report(-tensor_nbytes(t), "device")
                self._report(tensor_nbytes(t), "host")

    def fetch(self) -> None:
        """Queue the H2D copies (prefetch or on demand); no-op for what is already on the device."""
        side = None
        for i, (_, pin, streams) in enumerate(self.policy):
            if self.dev[i] is None:
                side = _side_stream(self.device[i]) if streams else None
                if self.stash is None:
                    self.dev[i] = _copy(self.host[i], self.device[i], pin, side)
                else:  # a pool buffer allocated on the compute stream, written on the side stream
                    buf, freed = self.stash.pool.take(self.host[i], self.device[i])
                    if side is not None and freed is not None:
                        side.wait_event(freed)  # its last reader (an earlier layer's re-run) has run
                    elif side is not None:  # new from the compute stream's pool: its queued work may still touch it
                        side.wait_stream(torch.cuda.current_stream(self.device[i]))
                    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                        self.dev[i] = buf.copy_(self.host[i], non_blocking=pin)
                    self.pooled[i] = True
                self._report(tensor_nbytes(self.host[i]), "device")
        if side is not None:
            self.events["h2d"] = torch.cuda.Event()
            self.events["h2d"].record(side)

    def wait(self) -> list[torch.Tensor]:
        """Make the current stream wait for the H2D copies; hand out the device tensors."""
        ev = self.events.pop("h2d", None)
        for i, (_, _, streams) in enumerate(self.policy):
            self._check_version(i)
            if ev is not None and streams and self.host[i] is not None:
                cur = torch.cuda.current_stream(self.device[i])
                cur.wait_event(ev)
                if not self.pooled[i]:
                    self.dev[i].record_stream(cur)  # allocated on the side stream, used on this one
        return list(self.dev)

    def release(self) -> None:
        if getattr(self, "dev", None) is not None:
            self._report(-sum(tensor_nbytes(t) for t in self.dev if t is not None), "device")
            self._report(-sum(tensor_nbytes(t) for t in self.host if t is not None), "host")
            if self.stash is not None:
                self.stash.host_bytes -= self.held_host
                for t, pooled in zip(self.dev, self.pooled):
                    if pooled and t is not None:
                        self.stash.pool.give(t)
            self.dev = self.host = None
            self.events.clear()

    __del__ = release  # a graph freed without backward still settles the accounts


class ActivationStash:
    """Owns the copies for a sequence of checkpointed calls (one per layer per forward).

    Offload is lazy: saving entry k queues the D2H copy of entry k-1, so the newest input (the last
    layer's) stays on device for the backward that starts right after. `load(k)` waits for entry
    k's H2D copy and queues entry k-1's (double buffer). Entries die with their autograd graph."""

    def __init__(self, config: OffloadConfig | None = None):
        self.config = config or OffloadConfig()
        self._entries: list[weakref.ref] = []  # forward order
        self.pool, self.host_bytes = BufferPool(), 0

    def save(self, tensors) -> StashEntry:
        live = [e for e in (r() for r in self._entries) if e is not None]
        self._entries = [weakref.ref(e) for e in live]
        if live and not live[-1].loaded:  # the previous input: kept under the device budget, else offloaded
            prev, budget = live[-1], self.config.device_budget_bytes
            kept = sum(e.device_bytes() for e in live[:-1] if e.resident and not e.loaded)
            if budget and kept + prev.device_bytes() <= budget:
                prev.resident = True
            else:
                prev.offload()
        entry = StashEntry(tensors, self.config, stash=self)
        self._entries.append(weakref.ref(entry))
        return entry

    def load(self, entry: StashEntry) -> list[torch.Tensor]:
        if entry.dev is None:
            raise RuntimeError("offloaded checkpoint: backward ran twice through the same forward "
                               "(retain_graph is not supported); run the forward again")
        entry.loaded = True
        entry.fetch()
        tensors = entry.wait()
        live = [r() for r in self._entries]
        k = next((i for i, e in enumerate(live) if e is entry), 0)
        prev = next((e for e in reversed(live[:k]) if e is not None and not e.loaded), None)
        if self.config.prefetch and prev is not None:
            prev.loaded = True
            prev.fetch()
        return tensors

    def release(self, entry: StashEntry) -> None:
        entry.release()
        self._entries = [r for r in self._entries if r() is not None and r() is not entry]

    def reserve_host(self, nbytes: int) -> int:
        """Count `nbytes` more host bytes (returned), or raise HostMemoryError past the config's host budget."""
        limit = self.config.host_budget_bytes
        if limit is not None and self.host_bytes + nbytes > limit:
            raise host_error(self.host_bytes + nbytes, limit)
        self.host_bytes += nbytes
        return nbytes

    def __deepcopy__(self, memo):  # streams/events do not copy; a model copy gets its own stash
        return ActivationStash(self.config)

