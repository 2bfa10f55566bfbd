"""Installation on a transformers model: our checkpoint function as the model's gradient-checkpointing function,
sticky across later `gradient_checkpointing_enable()` calls (Trainer init, TRL's generation unwrap)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from grpo_accel.core.model_access import causal_lm_of
from grpo_accel.offload.checkpoint import OffloadedCheckpoint
from grpo_accel.offload.config import OffloadConfig


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
    base = causal_lm_of(model)
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
    base = causal_lm_of(model)
    if not isinstance(base.__dict__.get("_set_gradient_checkpointing"), _StickyOffload):
        return False
    for module, func, flag in base.__dict__.pop("_set_gradient_checkpointing").saved:
        for name, value in (("_gradient_checkpointing_func", func), ("gradient_checkpointing", flag)):
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
    return True

