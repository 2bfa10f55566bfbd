"""Attention of one query tile against the keys and values up to its end (causal, lower-right aligned), for
tiling/layer.py: memory-linear in the tile and the keys, never a T x T score matrix; and the packed row's layout
(`Segment`), which the packed attention (grpo_accel.parallel.packing) and the tiled path both read.

A packed row holds several sequences. Each `Segment` attends causally within itself and, when it has a prefix, to
the whole of that earlier span first: the shared-prompt layout (grpo_accel.parallel.shared_prompt) puts a group's
prompt in the row once and each completion after it as a segment whose prefix is the prompt. A query at offset j of
the segment then sees the prefix's keys and its own keys 0..j: the keys [prefix ; own] with a lower-right causal
mask, exactly what it sees in its own unshared row. Cost: the prefix's keys and values are copied beside each
segment's (one [prefix + segment] K, V per segment, transient, per layer); the scores are (segment x (prefix +
segment)) per segment, never the whole row's square.

gpt-oss's two extras, in every path above (each segment has its own softmax, so its own sink and window):
  sinks     a learned logit per head in each softmax's denominator (eager: cat(scores, sink), softmax, drop the
            sink's column). Here one more key whose value is 0: the query gets a last column sink/scale
            (`with_sink_column`, inside the layer's graph so d(sink) flows back through it), every key a 0 there,
            and the sink key is 0 but a 1 there. Cost: head_dim + 8 for q, k, v (multiples of 8 keep CUDA's
            memory-linear kernels), one more key per softmax.
  window    a sliding layer's query sees its own key and the W - 1 before it. Here the keys before the band are
            cut off (a tile's keys start where its first query's window does) and a [Tq, Tq + W - 1] band mask
            covers the rest: the scores of a sliding tile are Tq x (Tq + W - 1), whatever the row's length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def _causal_lower_right(q_len: int, k_len: int):
    """torch's lower-right causal mask. Imported at the call: torch.nn.attention.bias imports torch._dynamo (~2.5 s
    on 2 cores), which `grpo-accel plan` (it imports this module for the packed-attention names) never uses."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q_len, k_len)


PACKED_ATTN = "grpo_accel_sdpa"  # the packed attention's name in transformers' attention interface
SEGMENTS_KWARG = "accel_segments"  # forward kwarg carried to every attention call: the packed row's segments


class Segment(NamedTuple):
    """Tokens start:end of a packed row, causal within; keys prefix_start:prefix_end (before start) seen whole."""
    start: int
    end: int
    prefix_start: int = 0
    prefix_end: int = 0


def segments_of(lengths) -> tuple[Segment, ...]:
    """Back-to-back sequences of these lengths, no prefixes (padding-free packing)."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return tuple(Segment(a, b) for a, b in zip(bounds[:-1], bounds[1:]))


SINK_PAD = 8  # q/k head dims stay multiples of 8: CUDA's memory-linear SDPA kernels need it (else the math kernel)


def with_sink_column(query, sinks, scale):
    """[B, heads, T, D + 8]: the query with sink/scale in column D and zeros after it (module docstring), for
    `attend_tile(..., sink=True)`; differentiable in both."""
    B, _, T, _ = query.shape
    col = (sinks.to(query.dtype) / scale).view(1, -1, 1, 1).expand(B, -1, T, 1)
    return torch.cat([query, col, query.new_zeros(B, query.shape[1], T, SINK_PAD - 1)], dim=-1)


def attend_tile(q, k, v, mask, start: int, dropout: float, scale, segments=None, window=None, sink=False):
    """softmax(q k^T * scale + causal / `mask` rows start:start+Tq) v for a query tile at `start`; memory-linear:
    no mask is built on CUDA (lower-right causal bias), a [Tq, e] bool mask on CPU (its flash kernel takes one).
    `segments` (Segment, ...): a packed row (module docstring); each query attends within its own segment only.
    `window` (keys a query sees, itself included) and `sink` (q from `with_sink_column`): gpt-oss's (module
    docstring); with a `mask` the mask already holds the window."""
    if segments is not None:
        end, outs = start + q.shape[2], []
        for seg in segments:
            a, b = max(seg.start, start), min(seg.end, end)  # this segment's queries in the tile, keys start:b
            if a >= b:
                continue
            ks, vs, offset = k[:, :, seg.start:b], v[:, :, seg.start:b], a - seg.start
            if seg.prefix_end > seg.prefix_start:  # [prefix ; own]: its gradient flows back to the one prefix
                pk, pv = k[:, :, seg.prefix_start:seg.prefix_end], v[:, :, seg.prefix_start:seg.prefix_end]
                ks, vs, offset = torch.cat([pk, ks], 2), torch.cat([pv, vs], 2), offset + pk.shape[2]
            outs.append(attend_tile(q[:, :, a - start:b - start], ks, vs, None, offset, dropout, scale, None, window,
                                sink))
        return torch.cat(outs, dim=2)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # autocast's own cast for SDPA, done by hand: the lower-right causal bias below dispatches through
        # torch.nn.attention.bias, which checks q, k, v share a dtype before autocast would cast them (under
        # autocast with fp32 weights RoPE leaves q, k in fp32 beside a half v)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if sink or (window and mask is None):
        return _attend_banded(q, k, v, mask, start, dropout, scale, window if mask is None else None, sink)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and (mask is not None or (start and not _flash_usable(q, k, v, dropout))):
        # a mask or lower-right bias reaches a memory-linear CUDA kernel through flash (GQA native) or efficient
        # attention (no GQA; with it SDPA falls to the math kernel and its [heads, Tq, e] scores): repeat K, V to
        # the query heads for this tile (2 * e * q_dim elements, transient), as transformers' sdpa does with a mask
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    if mask is not None:
        mask = mask[..., start:start + q.shape[2], :k.shape[2]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_lower_right(q.shape[2], k.shape[2]),
                                          dropout_p=dropout, scale=scale, enable_gqa=gqa)


WINDOW_BLOCK = 4096  # queries per band of a sliding layer: its mask is [4096, 4096 + W - 1], not [Tq, Tq + W - 1]


def _attend_banded(q, k, v, mask, start: int, dropout: float, scale, window, sink: bool):
    """`attend_tile` with a sliding window (no `mask`) and / or a sink key (module docstring). Keys are lower-right
    aligned with the queries (the last query sees the last key), as in `attend_tile`. A sliding layer's queries run in
    blocks of WINDOW_BLOCK: a whole 380K-token row (the no-grad passes do not tile) would otherwise build a
    [380K, 380K + W] band mask."""
    Tq, Tk = q.shape[2], k.shape[2]
    if window and mask is None and Tq > WINDOW_BLOCK:
        outs = []
        for a in range(0, Tq, WINDOW_BLOCK):  # block [a, b) of the queries sees keys up to Tk - Tq + b
            b = min(a + WINDOW_BLOCK, Tq)
            outs.append(_attend_banded(q[:, :, a:b], k[:, :, :Tk - Tq + b], v[:, :, :Tk - Tq + b], None, 0,
                                       dropout, scale, window, sink))
        return torch.cat(outs, dim=2)
    first = max(0, Tk - Tq - window + 1) if window else 0  # keys before every query's window: not computed
    k, v = k[:, :, first:], v[:, :, first:]
    if mask is not None:
        mask = mask[..., start:start + Tq, :Tk]
    elif window or not sink:
        i = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        j = torch.arange(first, Tk, device=q.device)[None]
        mask = (j <= i) & (j > i - window) if window else j <= i
    Dv = v.shape[-1]
    if sink:  # zero columns on every key, then the sink key (0, .., 0, 1, 0, ..) with value 0, seen by every query
        D = k.shape[-1]
        k, v = F.pad(k, (0, SINK_PAD)), F.pad(v, (0, q.shape[-1] - Dv))  # v as wide as q, k: one kernel for all
        sink_key = k.new_zeros(*k.shape[:2], 1, k.shape[3])
        sink_key[..., D] = 1
        k, v = torch.cat([sink_key, k], 2), torch.cat([v.new_zeros(*v.shape[:2], 1, v.shape[3]), v], 2)
        if mask is not None:
            seen = (torch.ones if mask.dtype == torch.bool else torch.zeros)(
                *mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device)
            mask = torch.cat([seen, mask], -1)
    gqa = q.shape[1] != k.shape[1]
    # a mask reaches CUDA's memory-linear kernels without GQA (as in `attend_tile`); a full layer's lower-right bias
    # through flash keeps GQA (repeating a 380K-token K, V to 64 heads would cost GBs)
    if gqa and q.is_cuda and (mask is not None or not _flash_usable(q, k, v, dropout)):
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    if mask is None:  # full layer with a sink: lower-right causal over [sink ; keys] keeps the sink visible
        mask = _causal_lower_right(Tq, k.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return out[..., :Dv]


def _flash_usable(q, k, v, dropout: float) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, dropout, True, True))
