"""Dtype names: every spelling a user or a config may write (fp32 / float32 / torch.float32 ...) to the planner's
short name, the long name transformers and TRL take, the torch dtype, and the bytes per element."""

from __future__ import annotations

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LONG = {short: long for long, short in SHORT.items()}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def short_name(name) -> str | None:
    """'fp32' / 'bf16' / 'fp16' for any spelling (a torch dtype too); None when it names no training dtype."""
    name = str(name).lower().replace("torch.", "")
    return name if name in LONG else SHORT.get(name)


def long_name(name) -> str | None:
    """'float32' / 'bfloat16' / 'float16' for any spelling; None when it names no training dtype."""
    short = short_name(name)
    return LONG[short] if short else None


def dtype_bytes(name) -> int:
    return BYTES[short_name(name)]


def torch_dtype(name):
    """The torch dtype for any spelling (also dtypes outside the training three, e.g. 'float64')."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, long_name(name) or str(name).replace("torch.", ""))
