"""Async activation offload for checkpointed decoder layers (and the hidden states fed to the head).

Naive equivalent: `torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)` on every decoder
layer, which keeps each layer's input x [B, T, H] on the GPU until backward: L·B·T·H·2 bytes in bf16
(43 GB for an 8B model at G=8, T=20K). Here each input is copied to pinned host memory on a side
CUDA stream while the next layer computes, and copied back in backward one layer ahead of need
(double buffer: when layer i's backward starts, the H2D copy of layer i-1's input is queued).
Device-resident saved inputs: ≤ 1 layer during forward (the newest input stays until the next layer
saves, so the last layer's input never leaves), ≤ 2 during backward, plus tensors under `min_bytes`.

Cost: B·T·H·2 bytes per layer each way over PCIe (~25 GB/s on Gen4 x16), against a layer's compute
of ~2·P_layer·B·T FLOPs. Copy/compute ≈ H·F / (25e9·P_layer) for achieved FLOP/s F: ~0.3 for an 8B
model (H=4096, P_layer=218M, F=400 TFLOP/s), ~1 for a 0.5B model (H=896, P_layer=15M), so the copy
hides behind compute for large models; pinned host memory of L·B·T·H·2 bytes is the price.
(transformers' `activation_checkpointing_enable(offload=True)` uses blocking `save_on_cpu` copies.)

Once the inputs are off the device, the largest term left is one layer's re-run in backward: everything
the layer saves for its own backward, ~230 KB per token for Llama-3.1-8B (15 GB for 8 × 8K tokens). The
backward therefore re-runs a layer one row group (<= `OffloadConfig.recompute_tokens`) at a time: rows
are independent sequences through a decoder layer, so the FLOPs stay the same (H100, Llama-3.1-8B LoRA,
G=8, T=8192: step peak 23981 -> 10470 MiB, TRL 1.16 38279 MiB; time 1.02x the same step without offload).

    model = AutoModelForCausalLM.from_pretrained(...)   # or a PeftModel, or a DeepSpeed engine
    install_activation_offload(model)                   # checkpointing on, with our function
    loss = model(**batch).loss; loss.backward()
    remove_activation_offload(model)

Without an accelerator the same function keeps inputs where they are (plain reentrant checkpointing:
the no-op twin). `OffloadConfig(device_copies=True, use_streams=False, pin_memory=False)` forces the
real copy path on CPU for tests; `SavedActivationTracker` reports where the saved bytes live.
Tests: `OMP_NUM_THREADS=1 pytest tests/test_offload.py`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = [
    "OffloadConfig", "ActivationStash", "OffloadedCheckpoint", "offloaded_checkpoint",
    "install_activation_offload", "remove_activation_offload", "offload_saved_tensors",
    "resolve_offload", "SavedActivationTracker",
]


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
    recompute_tokens: int | None = 16384


def resolve_offload(setting: bool | str, device: torch.device | str, gradient_checkpointing: bool = True) -> bool:
    """`True`/`False` as given (also as strings); `"auto"`: on when `device` is CUDA and gradient
    checkpointing is on (offload only moves what checkpointing saves)."""
    if isinstance(setting, bool):
        return setting
    key = setting.strip().lower() if isinstance(setting, str) else None
    if key not in ("auto", "true", "false"):
        raise ValueError(f"activation offload must be True, False or 'auto', got {setting!r}")
    if key == "auto":
        return torch.device(device).type == "cuda" and bool(gradient_checkpointing)
    return key == "true"


# ------------------------------------------------------------------------------------ accounting
_TRACKERS: list[SavedActivationTracker] = []


def _nbytes(t: torch.Tensor) -> int:
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


# ------------------------------------------------------------------------------------ the stash
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return _STREAMS[device] if device in _STREAMS else _STREAMS.setdefault(device, torch.cuda.Stream(device))


def _policy(t: torch.Tensor, cfg: OffloadConfig, min_bytes: int) -> tuple[bool, bool, bool]:
    """(copy to host?, pin?, side stream?) for one tensor."""
    copy = (t.device.type != "cpu" if cfg.device_copies is None else cfg.device_copies) and _nbytes(t) >= min_bytes
    pin = (t.is_cuda if cfg.pin_memory is None else cfg.pin_memory) and torch.cuda.is_available()
    return copy, pin, t.is_cuda and cfg.use_streams is not False


def _copy(src: torch.Tensor, device, pin: bool, stream) -> torch.Tensor:
    """Async copy (non_blocking when the host side is pinned), queued on `stream` when given."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return torch.empty_like(src, device=device, pin_memory=pin and device == "cpu").copy_(src, non_blocking=pin)


class _Entry:
    """The saved inputs of one checkpointed call; owned by its autograd ctx, indexed weakly by the
    stash. Per tensor: `dev[i]` (original or reloaded copy), `host[i]` (host copy), `policy[i]`."""

    def __init__(self, tensors, cfg: OffloadConfig, min_bytes: int | None = None):
        self.dev = [t.detach() for t in tensors]
        self.host = [None] * len(tensors)
        self.versions = [t._version for t in tensors]
        self.policy = [_policy(t, cfg, cfg.min_bytes if min_bytes is None else min_bytes) for t in tensors]
        self.device = [t.device for t in tensors]
        self.tracker = _TRACKERS[-1] if _TRACKERS else None
        self.events: dict[str, torch.cuda.Event] = {}
        self.loaded = False
        cuda = [d for d, p in zip(self.device, self.policy) if p[2]]
        if cuda:  # the inputs' ready point, so their D2H need not wait for the layer that reads them
            self.events["ready"] = torch.cuda.Event()
            self.events["ready"].record(torch.cuda.current_stream(cuda[0]))
        self._report(sum(map(_nbytes, tensors)), "device")

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
                if side is not None:
                    side.wait_event(self.events["ready"])
                self.host[i] = _copy(t, "cpu", pin, side)
                if side is not None:
                    t.record_stream(side)  # the caching allocator must not reuse t before the copy ran
                self.dev[i] = None
                self._report(-_nbytes(t), "device")
                self._report(_nbytes(t), "host")

    def fetch(self) -> None:
        """Queue the H2D copies (prefetch or on demand); no-op for what is already on the device."""
        side = None
        for i, (_, pin, streams) in enumerate(self.policy):
            if self.dev[i] is None:
                side = _side_stream(self.device[i]) if streams else None
                self.dev[i] = _copy(self.host[i], self.device[i], pin, side)
                self._report(_nbytes(self.host[i]), "device")
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
                self.dev[i].record_stream(cur)  # allocated on the side stream, used on this one
        return list(self.dev)

    def release(self) -> None:
        if getattr(self, "dev", None) is not None:
            self._report(-sum(_nbytes(t) for t in self.dev if t is not None), "device")
            self._report(-sum(_nbytes(t) for t in self.host if t is not None), "host")
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

    def save(self, tensors) -> _Entry:
        self._entries = [r for r in self._entries if r() is not None]
        if self._entries and not self._entries[-1]().loaded:
            self._entries[-1]().offload()
        entry = _Entry(tensors, self.config)
        self._entries.append(weakref.ref(entry))
        return entry

    def load(self, entry: _Entry) -> list[torch.Tensor]:
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

    def release(self, entry: _Entry) -> None:
        entry.release()
        self._entries = [r for r in self._entries if r() is not None and r() is not entry]

    def __deepcopy__(self, memo):  # streams/events do not copy; a model copy gets its own stash
        return ActivationStash(self.config)


# ------------------------------------------------------------------------------------ checkpoint
@contextlib.contextmanager
def _replay(ctx):
    """RNG, grad mode and autocast as they were in the forward, as torch's checkpoint does."""
    device_type = ctx.device_type or "cuda"  # CPU RNG is always forked; devices=[] touches no GPU
    with torch.random.fork_rng(devices=ctx.rng[1] if ctx.rng else [], enabled=bool(ctx.rng), device_type=device_type):
        if ctx.rng:
            torch.set_rng_state(ctx.rng[0])
            set_device_states(ctx.rng[1], ctx.rng[2], device_type=device_type)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for dev_type, kwargs in ctx.autocast.items():
                stack.enter_context(torch.autocast(dev_type, **kwargs))
            yield


def _forward_state(ctx, tensors, preserve_rng: bool) -> None:
    ctx.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
    ctx.autocast = {d: dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                            cache_enabled=torch.is_autocast_cache_enabled())
                    for d in ("cpu", ctx.device_type) if d is not None and torch.amp.is_autocast_available(d)}
    ctx.rng = None
    if preserve_rng:  # device RNG only when the device is initialized, like torch's checkpoint
        mod = torch.get_device_module(ctx.device_type) if ctx.device_type not in (None, "meta") else None
        states = get_device_states(*tensors) if getattr(mod, "_initialized", False) else ([], [])
        ctx.rng = (torch.get_rng_state(), *states)


_TENSOR = object()  # marks where the tensor outputs go back into the output pytree


class _OffloadedCheckpointFn(torch.autograd.Function):
    """Reentrant-style checkpoint whose saved inputs live in an `ActivationStash`.
    Args after `dummy` are the pytree leaves of (args, kwargs); `dummy` requires grad so the output
    does too when no input does (LoRA on a frozen embedding), without enable_input_require_grads."""

    @staticmethod
    def forward(ctx, run, stash, preserve_rng, spec, out_box, dummy, *flat):
        ctx.set_materialize_grads(False)
        ctx.recompute_tokens = stash.config.recompute_tokens
        ctx.run, ctx.stash, ctx.spec = run, stash, spec
        ctx.idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        tensors = [flat[i] for i in ctx.idx]
        ctx.flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
        ctx.requires = [t.requires_grad for t in tensors]
        _forward_state(ctx, tensors, preserve_rng)
        ctx.entry = stash.save(tensors)  # before running: the previous layer's D2H overlaps this compute
        args, kwargs = tree_unflatten(list(flat), spec)
        with torch.no_grad():
            leaves, out_spec = tree_flatten(run(*args, **kwargs))
        out_box.append((out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]))
        outs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        ctx.groups = _row_groups(run, tensors, outs, ctx.recompute_tokens)
        ctx.rows = tensors[0].shape[0] if ctx.groups else None
        return outs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("offloaded checkpoint is reentrant-style: use loss.backward(), "
                               "not torch.autograd.grad() or backward(inputs=...)")
        inputs = [t.detach().requires_grad_(r) for t, r in zip(ctx.stash.load(ctx.entry), ctx.requires)]
        if ctx.groups:
            in_grads = _grouped_rerun(ctx, inputs, grads)
        else:
            _rerun(ctx, inputs, grads)
            in_grads = [t.grad if r else None for t, r in zip(inputs, ctx.requires)]
        ctx.stash.release(ctx.entry)
        flat_grads = [None] * len(ctx.flat)
        for i, g in zip(ctx.idx, in_grads):
            flat_grads[i] = g
        return (None,) * 6 + tuple(flat_grads)


def _has_rows(x, rows: int) -> bool:
    """Whether `x` is batched along dim 0 with `rows` rows. 1-D tensors never are (cache_position is [T])."""
    return isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[0] == rows


def _rows_of(x, rows: slice, n: int):
    return x[rows] if _has_rows(x, n) else x


def _rerun(ctx, inputs, grads, run=None) -> None:
    """Re-run the checkpointed function (or `run`) on `inputs` with grad, and back-propagate `grads` through it."""
    flat = list(ctx.flat)
    for i, t in zip(ctx.idx, inputs):
        flat[i] = t
    args, kwargs = tree_unflatten(flat, ctx.spec)
    with _replay(ctx):
        out = (run or ctx.run)(*args, **kwargs)
    outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if pairs:  # parameter grads (LoRA, full fine-tune, ZeRO's hooks) accumulate here
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _grouped_rerun(ctx, inputs, grads) -> list:
    """`_rerun` one row group at a time: inputs, output grads and the tensors bound in the layer's partial (4-D masks,
    [B, T] position ids, RoPE tables) with `ctx.rows` rows are sliced, the others ([1, T] position ids, [T] cache
    positions) pass whole; parameter grads accumulate across groups, input grads are assembled."""
    n = ctx.rows
    batched = [_has_rows(t, n) for t in inputs]
    in_grads = [torch.zeros_like(t) if r and b else None for t, r, b in zip(inputs, ctx.requires, batched)]
    run = ctx.run
    for rows in ctx.groups:
        if isinstance(ctx.run, functools.partial):
            leaves, spec = tree_flatten(ctx.run.keywords)
            run = functools.partial(ctx.run.func, *ctx.run.args,
                                    **tree_unflatten([_rows_of(x, rows, n) for x in leaves], spec))
        part = [t.detach()[rows].requires_grad_(r) if b else t for t, r, b in zip(inputs, ctx.requires, batched)]
        _rerun(ctx, part, [g[rows] if g is not None else None for g in grads], run)
        for k, (t, b) in enumerate(zip(part, batched)):
            if in_grads[k] is not None and t.grad is not None:
                in_grads[k][rows] = t.grad
    return [g if b else (t.grad if r else None) for g, t, r, b in zip(in_grads, inputs, ctx.requires, batched)]


def _module_of(function) -> torch.nn.Module | None:
    """The module behind `function` (HF passes `partial(forward, layer, **kwargs)`), or None."""
    candidates, f = [], function
    while isinstance(f, functools.partial):
        candidates, f = candidates + list(f.args), f.func
    return next((c for c in candidates + [getattr(f, "__self__", None), f] if isinstance(c, torch.nn.Module)), None)


def _trainable_params(function) -> bool | None:
    """Whether the module behind `function` has parameters that require grad; None when no module can be found."""
    module = _module_of(function)
    return None if module is None else any(p.requires_grad for p in module.parameters())


def _row_groups(function, tensors, outs, recompute_tokens) -> list[slice] | None:
    """Row slices for a grouped backward re-run (see OffloadConfig.recompute_tokens), or None for one whole re-run.

    Whole when: the first input is not [B, T, ...] with B > 1 rows of more than one group; an output is not
    batched along dim 0; the module is unknown or has live dropout (a grouped re-run draws other random masks
    than the forward did); its parameters are ZeRO-3 partitions (each re-run would gather them again); or more
    than one process trains (DDP / DeepSpeed fire a parameter's gradient hook once per backward, not per group).
    """
    if not recompute_tokens or not tensors or tensors[0].ndim < 3 or not tensors[0].is_floating_point():
        return None
    rows, seq = tensors[0].shape[:2]
    per_group = max(1, recompute_tokens // max(seq, 1))
    if per_group >= rows or any(o.ndim == 0 or o.shape[0] != rows for o in outs):
        return None
    if isinstance(function, functools.partial):  # HF binds the layer's kwargs (masks, RoPE tables) in a partial
        if any(_has_rows(x, rows) for x in function.args):
            return None  # a bound positional tensor with rows: not sliced below
        if not all(x is None or isinstance(x, (torch.Tensor, bool, int, float, str, torch.dtype))
                   for x in tree_flatten(function.keywords)[0]):
            return None  # e.g. a flex-attention BlockMask or a cache: may hold rows we cannot slice
    module = _module_of(function)
    if module is None or any(hasattr(p, "ds_tensor") for p in module.parameters()):
        return None
    for m in module.modules():
        if m.training and ((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0)
                           or float(getattr(m, "attention_dropout", 0) or 0) > 0):
            return None
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return None
    return [slice(r, min(r + per_group, rows)) for r in range(0, rows, per_group)]


class OffloadedCheckpoint:
    """`checkpoint(function, *args, use_reentrant=None, preserve_rng_state=True, **kwargs)`, the call
    shape of `torch.utils.checkpoint.checkpoint` and `deepspeed.checkpointing.checkpoint`. Tensors in
    args and kwargs (nested in tuples/dicts too) are stashed; outputs may be any pytree of tensors.
    `use_reentrant` is accepted and ignored: this is always reentrant-style (needs `.backward()`)."""

    def __init__(self, config: OffloadConfig | None = None):
        self.stash = ActivationStash(config)

    def __call__(self, function, *args, use_reentrant=None, preserve_rng_state: bool = True, **kwargs):
        if not torch.is_grad_enabled():  # no_grad passes (TRL's old/ref log-probs) save nothing
            return function(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in flat):
            if _trainable_params(function) is False:
                return function(*args, **kwargs)  # nothing to differentiate: autograd saves nothing
        box: list = []
        outs = _OffloadedCheckpointFn.apply(function, self.stash, preserve_rng_state, spec, box,
                                            torch.empty(0, requires_grad=True), *flat)
        out_spec, leaves = box[0]
        it = iter(outs)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in leaves], out_spec)


_DEFAULT: list[OffloadedCheckpoint] = []


def offloaded_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """Drop-in for `torch.utils.checkpoint.checkpoint` with a process-wide default stash."""
    if not _DEFAULT:
        _DEFAULT.append(OffloadedCheckpoint())
    return _DEFAULT[0](function, *args, **kwargs)


# ------------------------------------------------------------------------------------ HF install
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """PeftModel -> base transformers model; DDP / DeepSpeedEngine -> .module."""
    for _ in range(8):
        if hasattr(type(model), "get_base_model"):
            model = model.get_base_model()
        elif not hasattr(type(model), "_set_gradient_checkpointing") and isinstance(
                getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model


class _StickyOffload:
    """Stands in for `model._set_gradient_checkpointing`, so every later enable (Trainer init,
    TRL's generation unwrap that disables and re-enables) keeps our function, not torch's."""

    def __init__(self, model, ckpt: OffloadedCheckpoint, saved: list):
        self.model, self.ckpt, self.saved = model, ckpt, saved

    def __call__(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
        func = self.ckpt if enable else (gradient_checkpointing_func or torch_checkpoint)
        return type(self.model)._set_gradient_checkpointing(
            self.model, enable=enable, gradient_checkpointing_func=func, every_n_layers=every_n_layers)


_MISSING = object()


def install_activation_offload(model: torch.nn.Module, config: OffloadConfig | None = None, *,
                               every_n_layers: int = 1) -> OffloadedCheckpoint:
    """Turn on gradient checkpointing of `model`'s decoder layers with `OffloadedCheckpoint`.
    `model`: a transformers model, a PeftModel around one, or a DDP/DeepSpeed wrapper. Stays in force
    across later `gradient_checkpointing_enable()` calls until `remove_activation_offload`."""
    base = _unwrap(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support gradient checkpointing, so its layers "
                         "cannot be offloaded: pass a transformers model (or a PeftModel around one)")
    remove_activation_offload(base)
    saved = [(m, m.__dict__.get("_gradient_checkpointing_func", _MISSING),
              m.__dict__.get("gradient_checkpointing", _MISSING))
             for m in base.modules() if hasattr(m, "gradient_checkpointing")]
    ckpt = OffloadedCheckpoint(config)
    base.__dict__["_set_gradient_checkpointing"] = _StickyOffload(base, ckpt, saved)
    base._set_gradient_checkpointing(enable=True, every_n_layers=every_n_layers)
    return ckpt


def remove_activation_offload(model: torch.nn.Module) -> bool:
    """Undo `install_activation_offload`: each module's checkpointing flag and function as before."""
    base = _unwrap(model)
    if not isinstance(base.__dict__.get("_set_gradient_checkpointing"), _StickyOffload):
        return False
    for module, func, flag in base.__dict__.pop("_set_gradient_checkpointing").saved:
        for name, value in (("_gradient_checkpointing_func", func), ("gradient_checkpointing", flag)):
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
    return True


# ------------------------------------------------------------------------------------ head offload
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
        if (not _policy(t, cfg, min_bytes)[0] or isinstance(t, torch.nn.Parameter)
                or isinstance(t._base, torch.nn.Parameter) or t.untyped_storage().data_ptr() in keep_ptrs):
            return t
        hit = seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1]() is not None:
            return hit[1]()
        entry = _Entry([t], cfg, min_bytes)
        entry.offload()
        seen[id(t)] = (weakref.ref(t), weakref.ref(entry))
        return entry

    def unpack(entry):
        if not isinstance(entry, _Entry):
            return entry
        entry.fetch()  # H2D on the side stream; the current stream waits in wait()
        return entry.wait()[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
