"""Reaching the HF model and its parameters through whatever wraps it (PEFT, DDP, a DeepSpeed engine, torch.compile).

Unwrapping is accelerate's `extract_model_from_parallel` (DDP, DataParallel, DeepSpeed engines, compiled modules)
then PEFT's `get_base_model`; ZeRO-3 partitioned parameters are read inside DeepSpeed's `GatheredParameters`."""

from __future__ import annotations

from contextlib import nullcontext


def causal_lm_of(model):
    """The HF *ForCausalLM (the transformers model) under PEFT / DDP / DeepSpeed / compile wrappers."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    # by type: a DeepSpeed engine forwards attribute lookups to the model inside, so hasattr would see through it
    if hasattr(type(model), "get_base_model"):
        model = model.get_base_model()
    return model


def zero3_gather_ctx(*params):
    """Gathers ZeRO-3-partitioned parameters for a direct read; a null context otherwise."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return nullcontext()
    if not is_deepspeed_zero3_enabled():
        return nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    todo = {id(p): p for p in params if p is not None and getattr(p, "ds_status", None) != ZeroParamStatus.AVAILABLE}
    return deepspeed.zero.GatheredParameters(list(todo.values())) if todo else nullcontext()
