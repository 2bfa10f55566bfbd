"""The checkpoint function: reentrant-style, its saved inputs live in an `ActivationStash`; backward reloads them
and re-runs the layer (whole, in row groups, or in sequence tiles: `rerun.py`, `tiling/layer.py`).

The layer's trainable parameters are explicit inputs of the Function, and its backward returns their grads (the
re-run's pieces summed on hook-free aliases, `rerun.param_aliases`) instead of a nested backward into the
parameters. So however many forwards ran before one backward (log-prob mini-batches), autograd sums the checkpoint
nodes' contributions and each parameter's AccumulateGrad, with the DDP / ZeRO-1/2 reduce hook on it, fires once
per backward, as without checkpointing (a nested backward per node fired it per forward: DDP's "mark a variable
ready only once", ZeRO-2's "Gradient computed twice"). Cost: as plain autograd, a parameter's summed grad is held
from its first node's backward to its last. ZeRO-3 partitions cannot be inputs (empty .data outside a gather:
autograd refuses a full-shape grad): they keep the nested backward, and only their last pending node marks the
grads ready for ZeRO-3's reduce (`rerun.zero3_last_use`)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from grpo_accel.offload import rerun
from grpo_accel.offload.config import OffloadConfig
from grpo_accel.offload.replay import forward_state, restore_rng
from grpo_accel.offload.stash import ActivationStash
from grpo_accel.tiling import layer as tiled

_TENSOR = object()  # marks where the tensor outputs go back into the output pytree


class OffloadedCheckpointFunction(torch.autograd.Function):
    """Reentrant-style checkpoint whose saved inputs live in an `ActivationStash`. After `dummy`: the layer's
    `n_params` trainable parameters, then the pytree leaves of (args, kwargs). `dummy` requires grad so the output
    does too when no input does (LoRA on a frozen embedding, module unknown), without enable_input_require_grads."""

    @staticmethod
    def forward(ctx, run, stash, preserve_rng, spec, out_box, n_params, dummy, *inputs):
        ctx.set_materialize_grads(False)
        ctx.recompute_tokens = stash.config.recompute_tokens
        ctx.run, ctx.stash, ctx.spec = run, stash, spec
        ctx.params, flat = list(inputs[:n_params]), inputs[n_params:]
        ctx.idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        tensors = [flat[i] for i in ctx.idx]
        ctx.flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
        ctx.requires = [t.requires_grad for t in tensors]
        forward_state(ctx, tensors, preserve_rng)
        ctx.entry = stash.save(tensors)  # before running: the previous layer's D2H overlaps this compute
        args, kwargs = tree_unflatten(list(flat), spec)
        with torch.no_grad():
            leaves, out_spec = tree_flatten(_run_forward(ctx, run, args, kwargs, preserve_rng))
        out_box.append((out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]))
        outs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        ctx.groups = rerun._row_groups(run, tensors, outs, ctx.recompute_tokens)
        ctx.rows = tensors[0].shape[0] if ctx.groups else None
        rerun.zero3_pending(rerun._module_of(run), ctx)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("offloaded checkpoint is reentrant-style: use loss.backward(), "
                               "not torch.autograd.grad() or backward(inputs=...)")
        inputs = [t.detach().requires_grad_(r) for t, r in zip(ctx.stash.load(ctx.entry), ctx.requires)]
        module = rerun._module_of(ctx.run)
        with rerun.param_aliases(module, ctx.params) as aliases, rerun.zero3_last_use(module, ctx):
            if ctx.groups:
                in_grads = rerun._grouped_rerun(ctx, inputs, grads)
            else:
                rerun._rerun(ctx, inputs, grads)
                in_grads = [t.grad if r else None for t, r in zip(inputs, ctx.requires)]
        ctx.stash.release(ctx.entry)
        flat_grads = [None] * len(ctx.flat)
        for i, g in zip(ctx.idx, in_grads):
            flat_grads[i] = g
        return (None,) * 7 + tuple(a.grad for a in aliases) + tuple(flat_grads)


def _run_forward(ctx, run, args, kwargs, preserve_rng: bool):
    """The layer under no_grad, in the pieces its re-run will use: row groups of <= recompute_tokens tokens, and
    sequence tiles when a row is longer (tiling/layer.py); else whole. Pieces bound the forward's transient tensors too
    (the MLP's [tokens, I] ones: 3 x 1.9 GB for 8 rows x 8K tokens of Llama-3.1-8B in one piece)."""
    module = rerun._module_of(run)
    ctx.tiles, ctx.tile_rng, ctx.shard = None, None, tiled.current_shard()
    if rerun._shared_params(module) is False:
        ctx.tiles = tiled.seq_tiles(run, args, kwargs, ctx.recompute_tokens, module)
    single = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
    groups = rerun._row_groups(run, list(args[:1]), (), ctx.recompute_tokens) if single else None
    if ctx.tiles:
        try:
            if not groups:
                out, ctx.tile_rng = tiled.forward(run, args[0], ctx.tiles,
                                                  preserve_rng and rerun._live_dropout(module), ctx.shard)
                return out
            return _grouped_forward(run, args[0], groups,
                                    lambda r, x: tiled.forward(r, x, ctx.tiles, False, ctx.shard)[0])
        except tiled.Untileable:
            ctx.tiles = None
            restore_rng(ctx)  # the first tile may have drawn dropout masks
    if groups:
        out = _grouped_forward(run, args[0], groups, lambda r, x: r(x))
        if out is not None:
            return out
    return run(*args, **kwargs)


def _grouped_forward(run, x: torch.Tensor, groups, call):
    """`call(run for the rows, x[rows])` per row group into one [B, ...] output; None (nothing written) when the
    first group's output is not one tensor with those rows (the caller runs the layer whole)."""
    n, y = x.shape[0], None
    for rows in groups:
        out = call(rerun._rows_partial(run, rows, n), x[rows])
        if y is None:
            if not isinstance(out, torch.Tensor) or out.shape[0] != rows.stop - rows.start:
                return None
            y = out.new_empty(n, *out.shape[1:])
        y[rows] = out
    return y


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
            if rerun._trainable_params(function) is False:
                return function(*args, **kwargs)  # nothing to differentiate: autograd saves nothing
        box: list = []
        params = rerun.trainable_params(rerun._module_of(function))
        outs = OffloadedCheckpointFunction.apply(function, self.stash, preserve_rng_state, spec, box, len(params),
                                            torch.empty(0, requires_grad=True), *params, *flat)
        out_spec, leaves = box[0]
        it = iter(outs)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in leaves], out_spec)


_DEFAULT: list[OffloadedCheckpoint] = []


def offloaded_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """Drop-in for `torch.utils.checkpoint.checkpoint` with a process-wide default stash."""
    if not _DEFAULT:
        _DEFAULT.append(OffloadedCheckpoint())
    return _DEFAULT[0](function, *args, **kwargs)

