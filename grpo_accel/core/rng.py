"""RNG state: one format, captured and restored in one place, for every re-run that must draw the forward's dropout
masks (checkpoint re-runs, sequence tiles, MLP tiles) and for the SP group's generation streams.

A state is (CPU generator state, device ids, their generator states), as torch.utils.checkpoint keeps it."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


def capture(*tensors: torch.Tensor):
    """The CPU generator's state and those of the accelerators `tensors` live on (with no tensor given: the current
    CUDA device, once CUDA is initialized). A device that was never initialized has drawn nothing: not touched."""
    if tensors:
        device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), None)
        module = torch.get_device_module(device_type) if device_type else None
        devices, states = get_device_states(*tensors) if getattr(module, "_initialized", False) else ([], [])
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        devices, states = [torch.cuda.current_device()], [torch.cuda.get_rng_state()]
    else:
        devices, states = [], []
    return torch.get_rng_state(), devices, states


def restore(state, device_type: str = "cuda") -> None:
    """Back to a `capture`d state."""
    cpu, devices, states = state
    torch.set_rng_state(cpu)
    if devices:
        set_device_states(devices, states, device_type=device_type)
