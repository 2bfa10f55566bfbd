"""The forward's RNG, grad mode and autocast state, recorded at the checkpointed call and replayed in the re-run
(as torch.utils.checkpoint does), so dropout masks and dtypes match the forward's."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import set_device_states

from grpo_accel.core import rng as rng_state


@contextlib.contextmanager
def replay_forward(ctx):
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


def forward_state(ctx, tensors, preserve_rng: bool) -> None:
    ctx.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
    ctx.autocast = {d: dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                            cache_enabled=torch.is_autocast_cache_enabled())
                    for d in ("cpu", ctx.device_type) if d is not None and torch.amp.is_autocast_available(d)}
    ctx.rng = rng_state.capture(*tensors) if preserve_rng else None  # device RNG only once initialized


def restore_rng(ctx) -> None:
    """Back to the RNG state recorded at the forward's start (after an abandoned attempt that may have drawn)."""
    if ctx.rng:
        rng_state.restore(ctx.rng, ctx.device_type or "cuda")
