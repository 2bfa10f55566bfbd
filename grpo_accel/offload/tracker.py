"""Where the saved-activation bytes live ("device" / "host"), with peaks: the stash reports to it, and with
`observe_autograd=True` it also counts what autograd itself saves (saved-tensor hooks, once per storage)."""

from __future__ import annotations

import weakref

import torch

_TRACKERS: list[SavedActivationTracker] = []


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Box:  # what the tracker's pack hook returns: weak-referenceable, so its death is observable
    __slots__ = ("t", "__weakref__")


class SavedActivationTracker:
    """Counts saved-activation bytes by where they live, "device" or "host", with peaks.

    Inside `with tracker:` the stash and `offload_saved_tensors` report every tensor they keep,
    copy, reload and free. `observe_autograd=True` also counts the tensors autograd itself saves
    (plain checkpointing, no checkpointing) via saved-tensor hooks, once per storage, skipping the
    storages of `ignore` (pass the model's parameters); those count as "device" when they sit on
    `device` (default: CUDA if present, else CPU). `reset_peak()` between forward and backward."""

    def __init__(self, observe_autograd: bool = False, ignore=(), device: torch.device | str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.bytes = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._ignore = {p.untyped_storage().data_ptr() for p in ignore}
        self._storages: dict[int, list] = {}  # data_ptr -> [refcount, nbytes, where]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if observe_autograd else None

    def add(self, nbytes: int, where: str) -> None:
        self.bytes[where] += nbytes
        self.peak[where] = max(self.peak[where], self.bytes[where])

    def reset_peak(self) -> None:
        self.peak = dict(self.bytes)

    def __enter__(self):
        _TRACKERS.append(self)
        if self._hooks is not None:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        _TRACKERS.remove(self)

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._ignore or ptr == 0:
            return t
        if ptr not in self._storages:
            self._storages[ptr] = [0, t.untyped_storage().nbytes(), "device" if t.device == self.device else "host"]
            self.add(*self._storages[ptr][1:])
        self._storages[ptr][0] += 1
        box = _Box()
        box.t = t
        weakref.finalize(box, self._drop, ptr)
        return box

    @staticmethod
    def _unpack(packed):
        return packed.t if isinstance(packed, _Box) else packed

    def _drop(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[ptr]
            self.add(-entry[1], entry[2])

