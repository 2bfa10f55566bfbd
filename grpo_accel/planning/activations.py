"""What autograd keeps per token of one decoder layer, and what its backward holds at once: the planner's activation
model (planning/memory.py sums it over layers, rows and pieces). Each term is counted from the modules' forward code
and checked against autograd's saved tensors on CPU (tests/test_memory.py: the dense MLP and both MoE families byte
for byte; a whole SmolLM2-135M layer within 4%).
"""

from __future__ import annotations

from grpo_accel.planning.architectures import ModelShape


def layer_saved_bytes_per_token(shape: ModelShape, act_bytes: int, lora_r: int) -> float:
    """Bytes one decoder layer saves for its backward, per token (HF Llama/Qwen layer, SDPA/flash attention).

    a = activation bytes (2 for bf16/fp16, 4 for fp32). Counted from what autograd keeps:
      two RMSNorms, each: the fp32 upcast of its input (4H), the normalized tensor (aH), the output (aH)
      q, k, v projection outputs (q + 2kv), the rotate_half copies of q and k (q + kv), rotated q and k (q + kv)
      attention output as SDPA saves it plus o_proj's contiguous input (2q), logsumexp (4 bytes x heads)
      MLP: gate, silu(gate), up, silu(gate)*up (4I)
      Qwen3 q/k norms: the same three tensors per RMSNorm on q and kv
      LoRA on the 7 linears: each lora_B saves lora_A's output (r); inputs are shared with the base layer.
    Measured on CPU (fp32, SmolLM2-135M shape, no checkpointing): 51.6 KB vs 53.5 KB predicted per token-layer.
    """
    H, q, kv, a = shape.hidden, shape.q_dim, shape.kv_dim, act_bytes
    norms = 2 * (4 * H + 2 * a * H)
    attention = a * (5 * q + 4 * kv) + 4 * shape.heads
    mlp = mlp_saved_bytes_per_token(shape, a)
    qk_norm = (4 + 2 * a) * (q + kv) if shape.qk_norm else 0
    return norms + attention + mlp + qk_norm + 7 * lora_r * a


# What a MoE block's expert loop saves (transformers 5.24, measured: tests/test_memory.py
# test_mlp_saved_bytes_match_autograd): per routed copy (k per token), `glu` tensors of I_e (gpt-oss's clamped
# SwiGLU with alpha keeps 7: gate_up [2 I_e], the clamped halves, the sigmoid, the product; Qwen3-MoE's SiLU GLU 4)
# and `index` int64 positions of the sorted dispatch; the router: gpt-oss soft-maxes the top-k logits in the
# activation dtype, Qwen3-MoE soft-maxes all E in fp32, then takes the top k and renormalizes them (their sum, fp32).
MOE_SAVED = {"gpt_oss": dict(glu=7, index=4, router_fp32=False),
             "qwen3_moe": dict(glu=4, index=3, router_fp32=True)}


def mlp_saved_bytes_per_token(shape: ModelShape, a: int) -> float:
    """What one layer's MLP saves per token, the mean over layers. Dense: gate, silu(gate), up, their product (4I).
    MoE (MOE_SAVED): the router's top-k indices [k int64] and weights, per routed copy the gathered input and the
    weighted output [H each], the GLU's tensors [glu x I_e], its routing weight [1] and the dispatch's int64 indices."""
    dense = a * 4 * shape.intermediate
    if not shape.moe_layers:
        return dense
    E, k, Ie = shape.experts, shape.experts_per_token, shape.expert_intermediate
    saved = MOE_SAVED.get(shape.moe_type, MOE_SAVED["gpt_oss"])  # an unknown MoE: the larger of the two
    router = 8 * k + (4 * E + 4 * k + 4 if saved["router_fp32"] else a * k)
    per_copy = a * (2 * shape.hidden + saved["glu"] * Ie + 1) + 8 * saved["index"]
    moe = router + k * per_copy
    return (shape.dense_mlp_layers * dense + shape.moe_layers * moe) / shape.layers


def layer_backward_transient_per_token(shape: ModelShape, act_bytes: int) -> int:
    """Gradients alive while one layer runs backward: d(out), d(in) [H each] and two MLP-sized grads [I each, or
    I_e for each of a MoE token's k experts]."""
    width = shape.experts_per_token * shape.expert_intermediate if shape.moe_layers else shape.intermediate
    return act_bytes * (2 * shape.hidden + 2 * max(width, shape.intermediate if shape.dense_mlp_layers else 0))


# PEFT's LoRA on a MoE layer's 3-D experts and router (lora.ParamWrapper; Qwen3-MoE, ModelShape.lora_experts) builds
# the adapted weights whole in every forward, W' = W + scale * B @ A in fp32 then in the weights' dtype, and the
# expert matmuls save W'. Forward and backward of one such layer then hold, beyond the frozen-expert layer, about 12
# bytes per expert and router weight at their peak (W' and d(W') in the weights' dtype, the fp32 delta and its
# gradient; measured on CPU, tiny-qwen3-moe, every count of tokens alike: 11.8 in fp32; in bf16 with the saved
# adapter copies 11.5 on an AVX-512-BF16 Xeon, 10.8 on an AVX2-only EPYC, whose bf16 GEMM kernels differ).
# The largest, as a plan must: tests/test_memory.py test_expert_adapters_cost_what_the_planner_says checks the plan is
# never under the measured peak and at most 15% over it on every CPU.
EXPERT_ADAPTER_PEAK_BYTES = 12


def expert_adapter_bytes(shape: ModelShape, act_bytes: int, lora_r: int) -> tuple[int, int]:
    """(saved, peak) bytes of one MoE layer's adapted experts under PEFT LoRA, independent of the tokens: `saved`,
    what the forward keeps for backward (W' of the experts and router in the weights' dtype; below fp32 also each
    expert's A and B cast to it, rank 2r on gate_up and r on down), counted from autograd's saved tensors; `peak`,
    what forward and backward hold at once (EXPERT_ADAPTER_PEAK_BYTES, measured). (0, 0) where the experts are not
    adapted (gpt-oss: PEFT adapts its attention only) or without LoRA."""
    if lora_r <= 0 or not shape.lora_experts or not shape.moe_layers:
        return 0, 0
    weights = shape.expert_params + shape.router_params
    H, Ie = shape.hidden, shape.expert_intermediate
    adapters = shape.experts * lora_r * (2 * (H + 2 * Ie) + (Ie + H)) if act_bytes < 4 else 0
    saved = act_bytes * (weights + adapters)
    return saved, EXPERT_ADAPTER_PEAK_BYTES * weights


def expert_grad_transient_bytes(shape: ModelShape, grad_bytes: int, lora_r: int) -> int:
    """Full fine-tuning of a MoE layer: each expert's slice of the 3-D weight (`gate_up_proj[e]`) back-propagates
    through select_backward, a zero tensor the size of the whole parameter, and autograd sums those per use before
    accumulating: one layer's expert weights twice, in the gradient dtype (from autograd's rules, not measured).
    LoRA: none here (PEFT's adapted experts on Qwen3-MoE: expert_adapter_bytes)."""
    return 2 * shape.expert_params * grad_bytes if lora_r <= 0 and shape.moe_layers else 0


__all__ = ["EXPERT_ADAPTER_PEAK_BYTES", "MOE_SAVED", "expert_adapter_bytes", "expert_grad_transient_bytes",
           "layer_backward_transient_per_token",
           "layer_saved_bytes_per_token", "mlp_saved_bytes_per_token"]
