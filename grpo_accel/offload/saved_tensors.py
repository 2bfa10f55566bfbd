"""Saved-tensor offload for code that is not a checkpointed layer (the head's hidden states): an asynchronous
`torch.autograd.graph.save_on_cpu` built on the stash's `StashEntry`."""

from __future__ import annotations

import contextlib
import weakref

import torch

from grpo_accel.offload.config import OffloadConfig
from grpo_accel.offload.stash import StashEntry, offload_policy


@contextlib.contextmanager
def offload_saved_tensors(min_bytes: int = 1 << 20, config: OffloadConfig | None = None, keep=()):
    """Saved-tensor hooks that hold large saved tensors on the host until backward.

    Same as `torch.autograd.graph.save_on_cpu(pin_memory=True)` but asynchronous (side stream, no
    host sync), skipping tensors under `min_bytes`, parameters (and views of them) and the storages
    of `keep`, and copying a tensor saved by several ops once. Use it around the final norm + LM
    head / log-prob computation, whose saved hidden states are G·T·H·2 bytes and more."""
    cfg = config or OffloadConfig()
    keep_ptrs = {t.untyped_storage().data_ptr() for t in keep}
    seen: dict[int, tuple] = {}  # id(tensor) -> (weakref to the tensor, weakref to its entry)

    def pack(t: torch.Tensor):
        if (not offload_policy(t, cfg, min_bytes)[0] or isinstance(t, torch.nn.Parameter)
                or isinstance(t._base, torch.nn.Parameter) or t.untyped_storage().data_ptr() in keep_ptrs):
            return t
        hit = seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1]() is not None:
            return hit[1]()
        entry = StashEntry([t], cfg, min_bytes)
        entry.offload()
        seen[id(t)] = (weakref.ref(t), weakref.ref(entry))
        return entry

    def unpack(entry):
        if not isinstance(entry, StashEntry):
            return entry
        entry.fetch()  # H2D on the side stream; the current stream waits in wait()
        return entry.wait()[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
