"""Fused log-prob head: per-token log p(target) (and entropy) of `hidden @ weight.T`, without the [N, V] logits.

Same as `(hidden @ weight.T).float().log_softmax(-1).gather(-1, t)` without the [N, V] tensor: for N = 160K
tokens and V = 128K that tensor is 80 GB in fp32, twice over with its gradient. Here the logits exist one
[chunk, tile] block at a time; each block is folded into per-token online-logsumexp statistics in fp32 and
dropped; backward recomputes the blocks (one extra GEMM, the cost of never storing them).

    logp, entropy = token_logprobs(hidden, lm_head.weight, targets, temperature=0.7, compute_entropy=True)
    # token_logprobs: ops/select.py

Logit transform, in the order HF models apply it (Gemma 2/3 `final_logit_softcapping` inside the model, then the
sampler's temperature, as TRL 1.16's chunked head does): z = softcap * tanh((h @ w) / softcap) / temperature.
Tokens whose target is `ignore_index` get logp 0, entropy 0, zero gradient, and cost no compute.

Implementations, picked by one string (`grpo_accel.ops.select.token_logprobs(..., impl=...)`):
  "reference"  plain torch over the full logits: the spec, used by the tests (fp64 in, fp64 out).
  "chunked"    `ChunkedLogprobs`: torch GEMM per block + in-place torch elementwise folds (any device).
  "triton"     the same blocks, folds done by Triton kernels (`logprobs_triton.py`), for CUDA.
  "auto"       triton for CUDA tensors when triton imports, else chunked.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from grpo_accel.ops.block_plan import (
    CPU_BUDGET_BYTES,
    CUDA_BUDGET_MAX_BYTES,
    live_blocks,
    plan_blocks_for_budget,
)

_HALF = (torch.float16, torch.bfloat16)


def logprobs_reference(hidden, weight, targets, temperature=1.0, softcap=None, ignore_index=-100):
    """The spec: full [N, V] logits in fp32 (fp64 if an input is fp64) -> (logp [N], entropy [N])."""
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    logits = hidden.to(acc) @ weight.to(acc).T
    if softcap is not None:  # HF order: the model softcaps, then the sampler divides by the temperature
        logits = softcap * torch.tanh(logits / softcap)
    logp_all = (logits / temperature).log_softmax(-1)
    valid = targets != ignore_index
    logp = logp_all.gather(-1, targets.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp.masked_fill(~valid, 0.0), entropy.masked_fill(~valid, 0.0)


def plan_blocks(n_rows, vocab, device, bytes_per_elem, chunk_size=None, vocab_tile=None):
    """(chunk, tile): rows and vocab columns per block, from the memory budget.

    budget = min(free CUDA memory / 16, 1 GiB) on CUDA, 32 MiB (last-level cache) on CPU
    tile   = vocab_tile or min(V, 4096 on CPU / 16384 on CUDA)
    chunk  = chunk_size or budget // (tile * bytes_per_elem), rounded down to a multiple of 16, in [16, N];
             when every row fits (chunk = N) and vocab_tile is not given, the tile widens to the budget instead
             (rounded down to a multiple of 128 columns, see _TILE_ALIGN).
    bytes_per_elem counts every live block: 4 per fp32 block plus 2 for a bf16/fp16 copy fed to the GEMMs.
    """
    device = torch.device(device)
    return plan_blocks_for_budget(n_rows, vocab, device.type, block_budget_bytes(device), bytes_per_elem, chunk_size,
                                  vocab_tile)


def block_budget_bytes(device) -> int:
    """Bytes the live blocks may take: min(free CUDA memory / 16, 1 GiB) on CUDA, 32 MiB on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(free // 16, CUDA_BUDGET_MAX_BYTES)
    return CPU_BUDGET_BYTES


_HAS_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype")


def _mm_out_dtype_ok(a):
    # torch >= 2.8 on CUDA: bf16/fp16 GEMM written as fp32, no rounding of the logits (or grads) to 16 bits
    return a.is_cuda and a.dtype in _HALF and _HAS_OUT_DTYPE


def gemm_operand(x, acc, cdt):
    # both operands in the compute dtype; CPU has no bf16 x bf16 -> fp32 GEMM: then upcast the operand
    # (a [chunk or tile, H] copy, small next to a [chunk, tile] block)
    x = x.to(cdt)
    return x if x.dtype == acc or _mm_out_dtype_ok(x) else x.to(acc)


def _gradient_outputs(hidden, weight, need_h: bool, need_w: bool, direct_w: bool, acc):
    """The backward's outputs: d(hidden) in its dtype, zeroed (rows of masked tokens stay 0); d(weight) either
    written tile by tile straight into the weight's dtype (`direct_w`) or accumulated in `acc` over token chunks."""
    grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
    if not need_w:
        return grad_h, None
    if direct_w:
        return grad_h, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return grad_h, torch.zeros(weight.shape, dtype=acc, device=weight.device)


def _mm(a, b, acc, out=None):
    """out += a @ b in `acc` precision."""
    if _mm_out_dtype_ok(a):  # the call form TRL 1.16 uses on CUDA
        return torch.addmm(out, a, b, out_dtype=acc, out=out)
    return out.addmm_(a, b)


def logits_block(a, h, w, acc):
    """a = h @ w.T in fp32 without a second block (CUDA bf16: zero + accumulate, the out_dtype form that exists)."""
    if _mm_out_dtype_ok(h):
        _mm(h, w.T, acc, out=a.zero_())
    else:
        torch.mm(h, w.T, out=a)


class TorchFolds:
    """Block folds in torch, in place on the fp32 block `a` (raw logits y = h @ w.T), fewest passes we found."""

    live_blocks = staticmethod(live_blocks)

    @staticmethod
    def forward_blocks(compute_entropy):
        return 1 + bool(compute_entropy)  # the logits block, and exp(z - m) for the entropy sum

    @staticmethod
    def forward(a, e, m, s, u, inv_t, softcap):
        """Fold block `a` into running max m, s = sum exp(z - m), u = sum exp(z - m) * (z - m) (u only if entropy)."""
        if softcap is not None:
            a.div_(softcap).tanh_().mul_(softcap * inv_t)
        elif inv_t != 1.0:
            a.mul_(inv_t)
        m_new = torch.maximum(m, a.amax(1))
        alpha = torch.exp(m - m_new)
        a.sub_(m_new[:, None])  # z - m_new <= 0
        if u is None:
            s.mul_(alpha).add_(a.exp_().sum(1))
        else:
            s_blk = torch.exp(a, out=e).sum(1)
            # re-centring u on m_new adds (m - m_new) * s; all terms <= 0, so entropy = log s - u/s never cancels.
            # e.mul_(a) in place: linalg.vecdot would allocate a third block for the product
            u.add_((m - m_new) * s).mul_(alpha).add_(e.mul_(a).sum(1))
            s.mul_(alpha).add_(s_blk)
        m.copy_(m_new)

    @staticmethod
    def backward(a, bufs, local, lse, ent, g_lp, g_ent, inv_t, softcap, out_dtype):
        """Turn block `a` into d(loss)/dy: g_lp (onehot - p) - g_ent p (log p + H), times dz/dy. Returns the block.

        g_lp, g_ent come pre-scaled by 1/T; out_dtype is only a hint (the caller casts for the GEMMs)."""
        if softcap is not None:
            th = a.div_(softcap).tanh_()
            z = torch.mul(th, softcap * inv_t, out=bufs[0])
        else:
            z = a.mul_(inv_t) if inv_t != 1.0 else a
        logp = z.sub_(lse[:, None])
        # g's are pre-scaled by 1/T (dz/dy without softcap) in backward(); signs folded in to save passes
        if g_ent is None:
            d = logp.exp_().mul_(-g_lp[:, None])
        else:
            p = torch.exp(logp, out=bufs[1] if softcap is not None else bufs[0])
            d = logp.add_(ent[:, None]).mul_(-g_ent[:, None])
            if g_lp is not None:
                d.sub_(g_lp[:, None])
            d.mul_(p)
        if g_lp is not None:
            hit = (local >= 0) & (local < d.shape[1])
            rows = hit.nonzero().squeeze(1)
            d.index_put_((rows, local[rows]), g_lp[rows], accumulate=True)
        if softcap is not None:  # d tanh = 1 - th^2:  d -= d * th^2
            d.addcmul_(d, th.square_(), value=-1.0)
        return d


class ChunkedLogprobs(torch.autograd.Function):
    """Autograd function behind `chunked_logprobs` / `triton_logprobs`; `folds` picks TorchFolds or Triton's.

    Saves hidden, weight, targets and per-token lse (+ entropy when computed): O(N) beyond the inputs.
    Cost: backward recomputes the forward GEMM (4 GEMMs in all, 3 if weight is frozen) instead of storing N*V.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, softcap, ignore_index, compute_entropy,
                chunk_size, vocab_tile, folds, cdt, weight_ctx=None):
        ctx.set_materialize_grads(False)  # entropy is often only logged: no grad, no backward work for it
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        valid = targets != ignore_index
        idx = None if bool(valid.all()) else valid.nonzero().squeeze(1)  # masked rows are skipped, not computed
        tgt = targets if idx is None else targets[idx]
        if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= v):
            raise ValueError(f"targets must be in [0, {v}) or equal ignore_index={ignore_index}")
        n_rows = tgt.numel()
        half_copy = hidden.is_cuda and cdt in _HALF
        bpe = 4 * folds.live_blocks(softcap, compute_entropy) + 2 * half_copy
        chunk, tile = plan_blocks(n_rows, v, hidden.device, bpe, chunk_size, vocab_tile)
        inv_t = 1.0 / temperature
        lse = torch.zeros(n, dtype=acc, device=hidden.device)
        logp = torch.zeros(n, dtype=acc, device=hidden.device)
        ent = torch.zeros(n, dtype=acc, device=hidden.device) if compute_entropy else None
        buf = torch.empty(chunk * tile * folds.forward_blocks(compute_entropy), dtype=acc, device=hidden.device)
        for r0 in range(0, n_rows, chunk):
            r1 = min(r0 + chunk, n_rows)
            rows = slice(r0, r1) if idx is None else idx[r0:r1]
            h = gemm_operand(hidden[rows], acc, cdt)
            t = tgt[r0:r1]
            m = torch.full((r1 - r0,), torch.finfo(acc).min, dtype=acc, device=hidden.device)  # finite: no inf*0
            s = torch.zeros_like(m)
            u = torch.zeros_like(m) if compute_entropy else None
            for c0 in range(0, v, tile):
                c1 = min(c0 + tile, v)
                a = buf[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
                e = buf[chunk * tile:][: a.numel()].view_as(a) if buf.numel() > chunk * tile else None
                logits_block(a, h, gemm_operand(weight[c0:c1], acc, cdt), acc)
                folds.forward(a, e, m, s, u, inv_t, softcap)
            # target logit as a row-wise dot: [chunk, H] work, no per-tile gather
            y_t = (h.to(acc) * weight[t].to(cdt).to(acc)).sum(1)  # same operand rounding as the GEMM
            z_t = (softcap * torch.tanh(y_t / softcap) if softcap is not None else y_t) * inv_t
            lse_c = m + s.log()
            lse[rows], logp[rows] = lse_c, z_t - lse_c
            if compute_entropy:
                ent[rows] = s.log() - u / s
        del buf
        ctx.save_for_backward(hidden, weight, targets, lse, *(() if ent is None else (ent,)))
        ctx.cfg = (temperature, softcap, ignore_index, chunk_size, vocab_tile, folds, cdt)
        ctx.weight_ctx = weight_ctx
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        # weight_ctx: re-materializes a weight that lives elsewhere between forward and backward (DeepSpeed
        # ZeRO-3 partitions it again after the forward's gather; the recompute needs it whole once more).
        with ctx.weight_ctx() if ctx.weight_ctx is not None else nullcontext():
            return ChunkedLogprobs._backward(ctx, grad_logp, grad_ent)

    @staticmethod
    def _backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        temperature, softcap, ignore_index, chunk_size, vocab_tile, folds, cdt = ctx.cfg
        ent = rest[0] if rest else None
        need_h, need_w = ctx.needs_input_grad[:2]
        if grad_ent is None or ent is None:
            grad_ent = None
        if (grad_logp is None and grad_ent is None) or not (need_h or need_w):
            return (None,) * 12
        v = weight.shape[0]
        acc = lse.dtype
        valid = targets != ignore_index
        idx = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        tgt = targets if idx is None else targets[idx]
        n_rows = tgt.numel()
        half_copy = hidden.is_cuda and cdt in _HALF
        bpe = 4 * folds.live_blocks(softcap, grad_ent is not None) + 2 * half_copy
        chunk, tile = plan_blocks(n_rows, v, hidden.device, bpe, chunk_size, vocab_tile)
        inv_t = 1.0 / temperature
        # pre-scale by dz/dy = 1/T: one [N] multiply instead of one block pass per tile
        g_lp = None if grad_logp is None else grad_logp.to(acc) * inv_t
        g_ent = None if grad_ent is None else grad_ent.to(acc) * inv_t
        # d(weight): an fp32 accumulator across token chunks (the output itself when weight is fp32). With one token
        # chunk each tile is written once, so a bf16/fp16 GEMM (fp32 accumulation inside cuBLAS, one rounding, as
        # the accumulator's final cast) writes it straight into the weight's dtype: no [V, H] fp32 buffer
        # (2 GB for Llama-3's head, which TRL 1.16 allocates at every size).
        direct_w = need_w and half_copy and weight.dtype == cdt and 0 < n_rows <= chunk
        grad_h, grad_w = _gradient_outputs(hidden, weight, need_h, need_w, direct_w, acc)
        n_bufs = folds.live_blocks(softcap, grad_ent is not None)
        bufs = torch.empty(n_bufs * chunk * tile, dtype=acc, device=hidden.device)
        for r0 in range(0, n_rows, chunk):
            r1 = min(r0 + chunk, n_rows)
            rows = slice(r0, r1) if idx is None else idx[r0:r1]
            h = gemm_operand(hidden[rows], acc, cdt)
            t = tgt[r0:r1]
            args = [x[rows] if x is not None else None for x in (lse, ent, g_lp, g_ent)]
            gh = torch.zeros(r1 - r0, hidden.shape[1], dtype=acc, device=hidden.device) if need_h else None
            for c0 in range(0, v, tile):
                c1 = min(c0 + tile, v)
                k = (r1 - r0) * (c1 - c0)
                a = bufs[:k].view(r1 - r0, c1 - c0)
                extra = [bufs[chunk * tile * i:][:k].view_as(a) for i in range(1, n_bufs)]
                w = gemm_operand(weight[c0:c1], acc, cdt)
                logits_block(a, h, w, acc)
                d = folds.backward(a, extra, t - c0, *args, inv_t, softcap, cdt if half_copy else acc)
                if half_copy:
                    d = d.to(cdt)  # bf16 tensor-core GEMMs, fp32 accumulate
                if need_h:
                    _mm(d, w, acc, out=gh)
                if direct_w:
                    torch.mm(d.T, h, out=grad_w[c0:c1])
                elif need_w:
                    _mm(d.T, h, acc, out=grad_w[c0:c1])
            if need_h:
                grad_h[rows] = gh.to(hidden.dtype)
        if need_w and grad_w.dtype != weight.dtype:
            # the blocks go before the cast, which holds the fp32 accumulator and its bf16 copy at once (H100,
            # N=16384, H=4096, V=128256: peak 4043 MiB with them alive, 3669 without; TRL 1.16 3646)
            bufs = a = extra = d = w = h = gh = None  # (rebinding, not del: with every token masked none exist)
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def chunked_logprobs(hidden, weight, targets, temperature=1.0, softcap=None, ignore_index=-100,
                     compute_entropy=False, chunk_size=None, vocab_tile=None, weight_ctx=None):
    """Chunked torch path: (logp [N] fp32, entropy [N] fp32 or None). hidden [N, H], weight [V, H], targets [N].

    Block sizes: `plan_blocks` (from free memory) unless chunk_size / vocab_tile are given.
    """
    return apply_fused_logprobs(hidden, weight, targets, temperature, softcap, ignore_index, compute_entropy,
                  chunk_size, vocab_tile, TorchFolds, weight_ctx)


def apply_fused_logprobs(hidden, weight, targets, temperature, softcap, ignore_index, compute_entropy, chunk_size,
                         vocab_tile, folds, weight_ctx=None):
    if hidden.ndim != 2 or weight.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)} (token_logprobs flattens [B, T, H])")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # GEMM operand dtype: autocast's when it is on (as TRL does), else the wider input dtype; stats stay fp32.
    # Autocast is then switched off inside so it cannot recast the per-block ops.
    dev = hidden.device.type
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(dev) and cdt != torch.float64:
        cdt = torch.get_autocast_dtype(dev)
    with torch.autocast(dev, enabled=False):
        return ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), softcap, ignore_index,
                                     compute_entropy, chunk_size, vocab_tile, folds, cdt, weight_ctx)
