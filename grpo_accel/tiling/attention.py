"""Attention of one query tile against the keys and values up to its end (causal, lower-right aligned), for
tiling/layer.py: memory-linear in the tile and the keys, never a T x T score matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def _attend(q, k, v, mask, start: int, dropout: float, scale, segments=None):
    """softmax(q k^T * scale + causal / `mask` rows start:start+Tq) v for a query tile at `start`; memory-linear:
    no mask is built on CUDA (lower-right causal bias), a [Tq, e] bool mask on CPU (its flash kernel takes one).
    `segments` (0, n0, n0+n1, ..., N): packed sequences, each query attends causally within its own only."""
    if segments is not None:
        end, outs = start + q.shape[2], []
        for lo, hi in zip(segments[:-1], segments[1:]):
            a, b = max(lo, start), min(hi, end)  # this sequence's queries in the tile, keys lo:b
            if a < b:
                outs.append(_attend(q[:, :, a - start:b - start], k[:, :, lo:b], v[:, :, lo:b], None, a - lo,
                                    dropout, scale))
        return torch.cat(outs, dim=2)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # autocast's own cast for SDPA, done by hand: the lower-right causal bias below dispatches through
        # torch.nn.attention.bias, which checks q, k, v share a dtype before autocast would cast them (under
        # autocast with fp32 weights RoPE leaves q, k in fp32 beside a half v)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          dropout_p=dropout, scale=scale, enable_gqa=gqa)


def _flash_usable(q, k, v, dropout: float) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, dropout, True, True))
