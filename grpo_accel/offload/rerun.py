"""The backward re-run of a checkpointed layer: whole, or one row group at a time (`OffloadConfig.recompute_tokens`).
Rows are independent sequences through a decoder layer, so the FLOPs stay the same and the re-run's saved tensors
exist for one group only."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from grpo_accel.offload.replay import replay_forward
from grpo_accel.tiling import layer as tiled


def _has_rows(x, rows: int) -> bool:
    """Whether `x` is batched along dim 0 with `rows` rows. 1-D tensors never are (cache_position is [T])."""
    return isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[0] == rows


def _rows_of(x, rows: slice, n: int):
    return x[rows] if _has_rows(x, n) else x


def _rerun(ctx, inputs, grads, run=None) -> None:
    """Re-run the checkpointed function (or `run`) on `inputs` with grad, and back-propagate `grads` through it;
    in sequence tiles when the forward ran in tiles (tiling/layer.py)."""
    if getattr(ctx, "tiles", None):
        if grads[0] is not None:
            with replay_forward(ctx):
                tiled.backward(run or ctx.run, inputs[0], grads[0], ctx.tiles, ctx.tile_rng,
                               getattr(ctx, "shard", None))
        return
    flat = list(ctx.flat)
    for i, t in zip(ctx.idx, inputs):
        flat[i] = t
    args, kwargs = tree_unflatten(flat, ctx.spec)
    with replay_forward(ctx):
        out = (run or ctx.run)(*args, **kwargs)
    outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if pairs:  # parameter grads accumulate here: into the aliases (`param_aliases`) or, ZeRO-3, the parameters
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _grouped_rerun(ctx, inputs, grads) -> list:
    """`_rerun` one row group at a time: inputs, output grads and the tensors bound in the layer's partial (4-D masks,
    [B, T] position ids, RoPE tables) with `ctx.rows` rows are sliced, the others ([1, T] position ids, [T] cache
    positions) pass whole; parameter grads accumulate across groups, input grads are assembled."""
    n = ctx.rows
    batched = [_has_rows(t, n) for t in inputs]
    in_grads = [torch.zeros_like(t) if r and b else None for t, r, b in zip(inputs, ctx.requires, batched)]
    for rows in ctx.groups:
        run = _rows_partial(ctx.run, rows, n)
        part = [t.detach()[rows].requires_grad_(r) if b else t for t, r, b in zip(inputs, ctx.requires, batched)]
        _rerun(ctx, part, [g[rows] if g is not None else None for g in grads], run)
        for k, t in enumerate(part):
            if in_grads[k] is not None and t.grad is not None:
                in_grads[k][rows] = t.grad
    return [g if b else (t.grad if r else None) for g, t, r, b in zip(in_grads, inputs, ctx.requires, batched)]


def _rows_partial(run, rows: slice, n: int):
    """`run` with the tensors bound in its partial that have `n` rows sliced to `rows` (masks, RoPE tables)."""
    if not isinstance(run, functools.partial):
        return run
    leaves, spec = tree_flatten(run.keywords)
    return functools.partial(run.func, *run.args, **tree_unflatten([_rows_of(x, rows, n) for x in leaves], spec))


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
    than the forward did); or its parameters are ZeRO-3 partitions (each re-run would gather them again). The groups'
    parameter grads are summed on aliases (`param_aliases`) and returned once by the checkpoint Function.
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
    if module is None or _shared_params(module) is not False or _live_dropout(module):
        return None
    return [slice(r, min(r + per_group, rows)) for r in range(0, rows, per_group)]



def _live_dropout(module: torch.nn.Module) -> bool:
    """Whether a re-run of `module` draws random numbers (dropout modules, attention dropout) in training."""
    return any(m.training and ((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0)
                               or float(getattr(m, "attention_dropout", 0) or 0) > 0) for m in module.modules())


def _shared_params(module: torch.nn.Module | None) -> bool | None:
    """Whether a re-run in pieces would upset parameter hooks: ZeRO-3 partitions (each piece gathers them again
    and the hooks need them gathered when the grads land). None when the module is unknown. Several processes
    (DDP / ZeRO-1/2) do not count: the pieces' parameter grads are summed and returned once (`param_aliases`)."""
    if module is None:
        return None
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


def trainable_params(module: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    """`module`'s parameters that require grad, each once; none when the module is unknown or its parameters are
    ZeRO-3 partitions (their .data is empty outside a gather: autograd would refuse a full-shape grad for them)."""
    params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
    return [] if any(hasattr(p, "ds_tensor") for p in params) else params


@contextlib.contextmanager
def param_aliases(module: torch.nn.Module | None, params: list[torch.nn.Parameter]):
    """Inside: `params` (of `module`) are replaced in it by hook-free aliases (same storage, fresh leaves), yielded
    in the same order; the re-run's pieces accumulate their grads into the aliases' .grad, which the checkpoint
    Function returns as its parameter inputs' grads. Cost: one grad buffer for this layer's trainable parameters
    (LoRA: KBs; full fine-tune: one layer's parameters), which autograd hands on to the parameters' .grad."""
    if not params:
        yield []
        return
    alias = {id(p): torch.nn.Parameter(p.detach(), requires_grad=True) for p in params}
    slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
             if p is not None and id(p) in alias]
    for m, name, p in slots:
        m._parameters[name] = alias[id(p)]
    try:
        yield [alias[id(p)] for p in params]
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


_ZERO3_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its checkpoint nodes to run


def zero3_pending(module: torch.nn.Module | None, ctx) -> None:
    """Count `ctx` (a checkpoint node in the graph) as a pending use of `module`'s ZeRO-3 partitions."""
    if module is not None and any(hasattr(p, "ds_tensor") and p.requires_grad for p in module.parameters()):
        _ZERO3_PENDING.setdefault(module, weakref.WeakSet()).add(ctx)


@contextlib.contextmanager
def zero3_last_use(module: torch.nn.Module | None, ctx):
    """ZeRO-3 partitions re-run in a nested backward into the real parameters, whose reduce hook fires per
    checkpoint node. With several forwards before one backward, only the last pending node of this module marks
    the grads ready (DeepSpeed's `ds_grad_is_ready`, meant for loops of transient grads): the earlier ones add into
    the full .grad, and ZeRO-3 reduces the sum once. Nodes of graphs freed without a backward drop out (weak)."""
    pending = _ZERO3_PENDING.get(module) if module is not None else None
    if pending is None or ctx not in pending:
        yield
        return
    pending.discard(ctx)
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor") and p.requires_grad]
    for p in params:
        p.ds_grad_is_ready = not pending
    try:
        yield
    finally:
        for p in params:
            p.__dict__.pop("ds_grad_is_ready", None)
