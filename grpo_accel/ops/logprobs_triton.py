"""Triton folds for the fused log-prob head: `triton_logprobs`, same signature and results as `chunked_logprobs`.

Same as `(hidden @ weight.T).float().log_softmax(-1).gather(-1, t)` without the [N, V] tensor.

Design: cuBLAS (torch.mm, bf16 in / fp32 out on CUDA) computes each [chunk, tile] logits block; Triton kernels do
everything elementwise on it in ONE pass each way:
  forward   one program per token: stream its row of the block, fold it into the online (max, sum-exp, and
            sum-exp * z for entropy) statistics; the block is read once and nothing is written.
  backward  one program per (token, 1024 columns): read y, rebuild p and log p from the saved lse, write
            g_lp (onehot - p) - g_ent p (log p + H), times the softcap/temperature chain, as bf16 for the two
            tensor-core GEMMs (fp32 accumulate) that follow.
Why not one fully fused matmul + logsumexp Triton kernel (Liger / ml-cross-entropy style)? The GEMMs are >90% of
the FLOPs at H >= 576, and cuBLAS on H100 is faster than a hand-tuned tl.dot kernel we could not tune without a
GPU; what fusion saves is the block's round trip to HBM (8 bytes/element forward, 10 backward), a few % of the
GEMM time at H = 4096. The torch folds (`TorchFolds`) need 4-5 block passes forward and 3-4 backward, which is
what these kernels remove: H100, bf16, N=16384, H=4096, V=128256, fwd+bwd 114 ms vs 161 ms for the torch folds
and 109 ms for TRL 1.16's head, which rounds the logits to bf16 before folding (benchmarks/results/logprobs.csv).
On CPU this file only runs under TRITON_INTERPRET=1, for correctness.

The autograd function, block planning and masked-token skipping are shared with the torch path
(`logprobs.ChunkedLogprobs`); only the folds differ.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as err:  # the dispatcher imports this module only for impl="triton"
    raise ImportError("impl='triton' needs triton: pip install 'grpo_accel[triton]' (or use impl='chunked')") from err

import torch

from grpo_accel.ops.logprobs import apply_fused_logprobs

_BLOCK_V = 1024


@triton.jit
def _transform(y, inv_t, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        th = 2 * tl.sigmoid(2 * y / softcap) - 1  # tanh; tl has no portable tanh (interpreter included)
        z = softcap * th * inv_t
    else:
        th = y
        z = y * inv_t
    return z, th


@triton.jit
def _fold_forward_kernel(a_ptr, stride, m_ptr, s_ptr, u_ptr, n_cols, inv_t, softcap,
                         HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    u = s * 0
    if HAS_ENTROPY:
        u = tl.load(u_ptr + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        y = tl.load(a_ptr + row * stride + cols, mask=mask, other=0.0)  # fp32 (fp64 for fp64 inputs)
        z, _ = _transform(y, inv_t, softcap, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        d = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        if HAS_ENTROPY:  # u = sum e * (z - m), re-centred on m_new; m starts finite so (m - m_new) * 0 is 0
            u = alpha * (u + (m - m_new) * s) + tl.sum(e * d, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if HAS_ENTROPY:
        tl.store(u_ptr + row, u)


@triton.jit
def _grad_kernel(a_ptr, a_stride, d_ptr, d_stride, local_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, n_cols,
                 inv_t, softcap, HAS_SOFTCAP: tl.constexpr, HAS_LP_GRAD: tl.constexpr,
                 HAS_ENT_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    y = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0)
    z, th = _transform(y, inv_t, softcap, HAS_SOFTCAP)
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    grad = tl.zeros_like(p)
    if HAS_LP_GRAD:  # d log p_t / dz_j = [j = t] - p_j   (g pre-scaled by 1/T)
        g = tl.load(glp_ptr + row)
        hit = cols == tl.load(local_ptr + row)
        grad += g * (hit.to(p.dtype) - p)
    if HAS_ENT_GRAD:  # dH / dz_j = -p_j (log p_j + H)
        grad -= tl.load(gent_ptr + row) * p * (logp + tl.load(ent_ptr + row))
    if HAS_SOFTCAP:
        grad = grad * (1 - th * th)
    tl.store(d_ptr + row * d_stride + cols, grad.to(d_ptr.dtype.element_ty), mask=mask)


class TritonFolds:
    """Folds with the `TorchFolds` interface, each one Triton launch over the block."""

    @staticmethod
    def live_blocks(softcap, compute_entropy):
        return 1  # in place; the bf16 copy for the backward GEMMs is counted by the caller

    @staticmethod
    def forward_blocks(compute_entropy):
        return 1  # the fold kernel reads the logits block once and writes nothing back

    @staticmethod
    def forward(a, e, m, s, u, inv_t, softcap):
        n, w = a.shape
        _fold_forward_kernel[(n,)](a, a.stride(0), m, s, u if u is not None else s, w, inv_t,
                                   float(softcap or 1.0), HAS_SOFTCAP=softcap is not None,
                                   HAS_ENTROPY=u is not None, BLOCK_V=_BLOCK_V)

    @staticmethod
    def backward(a, bufs, local, lse, ent, g_lp, g_ent, inv_t, softcap, out_dtype):
        n, w = a.shape
        d = a if out_dtype == a.dtype else torch.empty((n, w), dtype=out_dtype, device=a.device)
        dummy = lse
        _grad_kernel[(n, triton.cdiv(w, _BLOCK_V))](
            a, a.stride(0), d, d.stride(0), local.contiguous(), lse.contiguous(),
            (ent if ent is not None else dummy).contiguous(),
            (g_lp if g_lp is not None else dummy).contiguous(),
            (g_ent if g_ent is not None else dummy).contiguous(),
            w, inv_t, float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, HAS_LP_GRAD=g_lp is not None,
            HAS_ENT_GRAD=g_ent is not None, BLOCK_V=_BLOCK_V)
        return d


def triton_logprobs(hidden, weight, targets, temperature=1.0, softcap=None, ignore_index=-100,
                    compute_entropy=False, chunk_size=None, vocab_tile=None, weight_ctx=None):
    """Triton path: (logp [N] fp32, entropy [N] fp32 or None); see `chunked_logprobs` for the arguments."""
    return apply_fused_logprobs(hidden, weight, targets, temperature, softcap, ignore_index, compute_entropy,
                  chunk_size, vocab_tile, TritonFolds, weight_ctx)
