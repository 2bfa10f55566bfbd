"""Sequence-tiled MLP: a decoder layer's MLP over [B, T, H] in tiles of `tokens` tokens, saving only its input.

Naive equivalent: `mlp(x)`, whose backward keeps gate, up, act(gate) and act(gate)·up ([B, T, I] each; I = 12288 for
Qwen3-8B: 98 KB a token in bf16) and, while it runs, two more [B, T, I] gradients. Here the forward runs tile by tile
under no_grad and saves x; the backward re-runs each tile with grad and back-propagates that tile's slice of d(out),
so [tile, I] tensors exist for one tile at a time. The MLP is token-local, so this is the same function; dropout
(LoRA's) draws per tile, and each tile's RNG state is recorded and replayed so backward sees the forward's masks.

Where: on Ulysses SP shards (grpo_accel.parallel.sequence_parallel), for the calls that do not run in whole-layer
sequence tiles (parallel/ulysses_tiles.py): the no-grad log-prob passes over a whole shard, and re-runs that cannot be
tiled (live dropout). A layer then holds its attention part for the whole shard and its MLP part for one tile
(Snowflake ALST's TiledMLP). Inside a layer tile the MLP's input is no longer than a tile: it runs whole.
Cost: one more MLP forward (inside a checkpointed layer's re-run: three in all instead of two, ~+22% of an 8B
layer's FLOPs in that re-run). The tiles' parameter grads are summed by autograd.grad and returned once as the
Function's outputs, so DDP / ZeRO-1/2 hooks fire once. ZeRO-3 partitions: not tiled (the re-run would bypass the
module hooks that gather them).
"""

from __future__ import annotations

import torch

from grpo_accel.core import rng as rng_state
from grpo_accel.tiling.layer import set_rng

_FLAG = "_accel_tiled_mlp"


def _trainable(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, run, tiles, x, *params):
        ctx.module, ctx.run, ctx.tiles = module, run, tiles
        dev = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), dev)
        ctx.rng = []
        out = None
        for sl in tiles:
            ctx.rng.append(rng_state.capture(x))
            y = run(x[:, sl])
            out = x.new_empty((*x.shape[:2], *y.shape[2:]), dtype=y.dtype) if out is None else out
            out[:, sl] = y
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        # the parameters the run uses now (offload.rerun may have swapped in same-storage aliases): their grads are
        # the grads of the Function's parameter inputs, position by position
        params = _trainable(ctx.module)
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        dps = [None] * len(params)
        enabled, dtype, dev = ctx.autocast
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []), torch.enable_grad(), \
                torch.autocast(dev, enabled=enabled, dtype=dtype):
            for i, sl in enumerate(ctx.tiles):
                set_rng(ctx.rng, i)
                xt = x.detach()[:, sl].requires_grad_(dx is not None)
                y = ctx.run(xt)
                wrt = ([xt] if dx is not None else []) + params
                grads = list(torch.autograd.grad(y, wrt, g[:, sl], allow_unused=True))
                if dx is not None:
                    dx[:, sl] = grads.pop(0)
                dps = [d if a is None else a if d is None else d + a for d, a in zip(dps, grads)]
        return (None, None, None, dx, *dps)


# MLP classes run in tiles: dense MLPs (Llama, Qwen, Mistral, Gemma) and MoE blocks (gpt-oss's GptOssMLP, Qwen3-MoE's
# SparseMoeBlock), whose router picks experts per token: token-local too (tests/test_moe.py)
_MLP_CLASSES = ("MLP", "SparseMoeBlock")


def _first_tensor(run):
    """`run` on a contiguous tile (Qwen3-MoE's block views it as [tokens, H]; a copy of one tile) returning its output
    tensor; gpt-oss's MoE MLP returns (out, router scores), the scores unused by its layer: the box says a tuple came
    back (the tiled forward then returns (out, None))."""
    box = []

    def call(x):
        y = run(x.contiguous())
        if isinstance(y, tuple):
            box.append(True)
            return y[0]
        return y

    return call, box


def install(model: torch.nn.Module, tokens: int) -> int:
    """Run each decoder layer's MLP (a submodule named `mlp` whose class name ends in one of _MLP_CLASSES) in tiles
    of `tokens` tokens when its input is longer. Returns how many were patched."""
    patched = 0
    for name, module in model.named_modules():
        if (not name.endswith("mlp") or not type(module).__name__.endswith(_MLP_CLASSES)
                or getattr(module, _FLAG, False)):
            continue
        run = module.forward

        def forward(x, *args, _run=run, _module=module, **kwargs):
            if (args or kwargs or not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[1] <= tokens
                    or any(hasattr(p, "ds_tensor") for p in _module.parameters())):
                return _run(x, *args, **kwargs)
            tiles = [slice(s, min(s + tokens, x.shape[1])) for s in range(0, x.shape[1], tokens)]
            call, was_tuple = _first_tensor(_run)
            if not torch.is_grad_enabled():
                out = torch.cat([call(x[:, sl]) for sl in tiles], dim=1)
            else:
                out = _TiledMLP.apply(_module, call, tiles, x, *_trainable(_module))
            return (out, None) if was_tuple else out

        module.forward = forward
        setattr(module, _FLAG, True)
        patched += 1
    return patched


def uninstall(model: torch.nn.Module) -> None:
    """Undo `install`: each patched MLP runs its class's forward again."""
    for module in model.modules():
        if module.__dict__.pop(_FLAG, False):
            module.__dict__.pop("forward", None)
