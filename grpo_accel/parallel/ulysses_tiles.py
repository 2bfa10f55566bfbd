"""Sequence tiles on a Ulysses SP shard: tiling/layer.py's layer tiles when each rank of an SP group holds L tokens of
every row (grpo_accel.parallel.sequence_parallel) and a tile's queries need keys that other ranks hold.

Naive equivalent: the shard's layer re-run whole, its attention through Ulysses' all-to-all; the re-run's saved
tensors (~150 KB a token for Qwen3-8B in bf16 without the MLP) exist for all L tokens at once. Here, as in
tiling/layer.py, the layer runs `recompute_tokens` tokens at a time, every rank its tile i at the same step; inside
the attention call (HF's attention interface, hooked) a tile's q / k / v go through an all-to-all of their own: [t
tokens, all heads]
-> [the sp ranks' tile i, heads/sp]. Keys: a query at global position p needs every key <= p, and with shards
[r·L, (r+1)·L) those include the *later* tiles of lower ranks, so unlike tiling/layer.py the keys cannot be filled as
the queries go:

- forward (no grad): pass 1 runs every tile's pre-attention part and fills full-length head-sharded K, V
  [B, kv/sp, sp·L, d]; pass 2 runs every tile again, its queries attending (per source rank, causal, lower-right
  aligned) to K, V up to their positions, the output all-to-all'd back, then the rest of the layer.
- backward (re-run): pass 1 as above; pass 2 per tile with grad through the post-attention part: d(out) all-to-all'd
  to heads, the attention's backward: dq (all-to-all'd back, kept for the shard: [B, heads, L, d]) and dK, dV
  accumulated in fp32 over every query tile; pass 3, once dK, dV are complete, per tile: the pre-attention part
  again with grad, back-propagating dq and its slice of dK, dV (all-to-all'd back).

Cost against a whole-shard re-run: the pre-attention part (norm, q/k/v projections) runs twice more (~8% of an 8B
layer's FLOPs in forward + backward), 3 more all-to-alls of q/k/v-sized tiles per pass (the same bytes as Ulysses'
own); memory: K, V, one tile's d(K), d(V) and the fp32 dK, dV sums for the whole sequence but heads/sp of them
(2·T·kv/sp·d·(2a+4) bytes), dq and d(x) for the shard, and one tile's layer.

gpt-oss: the sink column joins each tile's query in the tokens layout, all heads, before the all-to-all
(tiling/attention.with_sink_column), so each rank receives the sinks of its own heads with them; in pass 3 it is in
the pre-attention graph, so dq carries d(sinks) back. Sliding windows need nothing more: positions in K, V are
global, and `attend_tile` cuts each query tile's keys to its window. Not tiled (Untileable, whole-shard
re-run, as in tiling/layer.py): live dropout, attention dropout, attention calls the hook does not understand. Every
rank decides alike (same shapes, same model), so the collectives stay in step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from grpo_accel.tiling.attention import attend_tile, with_sink_column
from grpo_accel.tiling.layer import (
    GPT_OSS_KWARGS,
    StopTile,
    Untileable,
    add_input_grad,
    attention_hook,
    backward_pairs,
    call_tile,
    forward_tile,
    kv_pass,
    unsupported_attention,
)

# forward kwarg carried to every attention call of a shard (and bound into the checkpoint's re-run):
# grpo_accel.parallel.sequence_parallel routes such calls through Ulysses, this module's hook drops it
SP_KWARG = "accel_sp"


class _SPTiling:
    """One tiled call on a shard of L tokens a row: the group, the current tile `sl`, the mode ("kv", "forward",
    "grad", "pre"), full-length head-sharded K, V (dK, dV), and what the hook hands back."""

    def __init__(self, group, L: int, mode: str):
        self.group, self.sp, self.L = group, dist.get_world_size(group), L
        self.mode, self.sl, self.calls = mode, None, 0
        self.K = self.V = self.dK = self.dV = None
        self.rep = 1  # kv heads repeated up to sp when there are fewer (DeepSpeed's Ulysses does the same)
        self.extras = (None, False)  # gpt-oss: (sliding window, sinks joined the query), for `attend_tile`
        self.saved = None  # "grad": (q leaf, K leaf, V leaf, attention output in heads, o leaf)
        self.pre = None  # "pre": (q, k, v) with their graphs

    # all-to-alls between [B, h, t, d] (this rank's tile, all heads) and [B, h/sp, sp·t, d] (every rank's tile i,
    # this rank's heads, ordered by rank)
    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, h, t, d = x.shape
        send = x.reshape(B, self.sp, h // self.sp, t, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 2, 0, 3, 4).reshape(B, h // self.sp, self.sp * t, d)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        B, hs, st, d = x.shape
        t = st // self.sp
        send = x.reshape(B, hs, self.sp, t, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.transpose(0, 1).reshape(B, self.sp * hs, t, d)

    def positions(self):
        """Where the rows of a heads-layout tile go in the full sequence: source rank s's tile at s·L + sl."""
        a, b = self.sl.start, self.sl.stop
        return [(s * self.L + a, s * self.L + b) for s in range(self.sp)]

    def _repeat(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.rep, 1) if self.rep > 1 else kv

    def hook(self, impl, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        self.calls += 1
        kwargs.pop(SP_KWARG, None)
        # packed segments (accel_segments) included: not here
        bad = unsupported_attention(impl, module, kwargs, allow=GPT_OSS_KWARGS)
        if dropout:
            bad.append("attention dropout")
        t = self.sl.stop - self.sl.start
        if bad or self.calls > 1 or query.shape[2] != t or key.shape[2] != t or \
                key.shape[1] % self.sp and self.sp % key.shape[1]:
            raise Untileable(f"attention call with {bad or 'an unexpected shape'} on an SP shard")
        # the attention mask (if the model built one for the shard) is ignored: Ulysses attends causally by position
        window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
        self.extras = (window, sinks is not None)
        if sinks is not None and self.mode != "kv":  # the graph through the sinks is pass 3's ("pre") alone
            query = with_sink_column(query, sinks, scaling) if self.mode == "pre" else \
                with_sink_column(query.detach(), sinks.detach(), scaling)
        if self.mode == "pre":
            self.pre = (query, key, value)
            raise StopTile
        if self.mode == "kv":
            self.rep = max(1, self.sp // key.shape[1])
            kh, vh = self.to_heads(self._repeat(key)), self.to_heads(self._repeat(value))
            if self.K is None:
                B, hs, _, d = kh.shape
                self.K = kh.new_empty(B, hs, self.sp * self.L, d)
                self.V = vh.new_empty(B, hs, self.sp * self.L, d)
            for s, (a, b) in enumerate(self.positions()):
                self.K[:, :, a:b], self.V[:, :, a:b] = kh[:, :, s * t:(s + 1) * t], vh[:, :, s * t:(s + 1) * t]
            raise StopTile
        if self.mode == "forward":
            out = self.attend(self.to_heads(query), self.K, self.V, scaling)
            return self.to_tokens(out).transpose(1, 2), None
        q_leaf = self.to_heads(query.detach()).requires_grad_()
        k_leaf, v_leaf = self.K.detach().requires_grad_(), self.V.detach().requires_grad_()
        out = self.attend(q_leaf, k_leaf, v_leaf, scaling)
        o_leaf = self.to_tokens(out.detach()).transpose(1, 2).requires_grad_()
        self.saved = (q_leaf, k_leaf, v_leaf, out, o_leaf)
        return o_leaf, None

    def attend(self, qh, K, V, scaling):
        """Each source rank's query tile against the keys up to its own end (causal, lower-right aligned)."""
        t = qh.shape[2] // self.sp
        return torch.cat([attend_tile(qh[:, :, s * t:(s + 1) * t], K[:, :, :b], V[:, :, :b], None, a, 0.0, scaling,
                                  None, *self.extras)
                          for s, (a, b) in enumerate(self.positions())], dim=2)

    def kv_grads(self):
        """This rank's tile's slice of dK, dV ([B, kv, t, d], repeats summed), from the heads layout."""
        t = self.sl.stop - self.sl.start
        out = []
        for D in (self.dK, self.dV):
            g = self.to_tokens(torch.cat([D[:, :, a:b] for a, b in self.positions()], dim=2))
            if self.rep > 1:
                g = g.view(g.shape[0], -1, self.rep, t, g.shape[-1]).sum(2)
            out.append(g)
        return out


def forward(run, x: torch.Tensor, tiles, group) -> torch.Tensor:
    """The layer on this rank's shard x [B, L, H], tile by tile under no_grad (module docstring). Raises Untileable
    before any collective when the first tile's attention call is not one this path reproduces."""
    state = _SPTiling(group, x.shape[1], "kv")
    y = None
    with attention_hook(state.hook), torch.no_grad():
        kv_pass(state, run, x, tiles)
        state.mode = "forward"
        for sl in tiles:
            y = forward_tile(state, run, x, sl, y)
    return y


def backward(run, x: torch.Tensor, g: torch.Tensor, tiles, group) -> None:
    """Re-run the layer on this rank's shard tile by tile and back-propagate `g` (module docstring); parameter grads
    accumulate, `x.grad` gets d(x) when x requires grad. Call under the forward's autocast."""
    state = _SPTiling(group, x.shape[1], "kv")
    dx = torch.zeros_like(x) if x.requires_grad else None
    with attention_hook(state.hook):
        kv_pass(state, run, x, tiles)
        state.dK, state.dV = (torch.zeros_like(t, dtype=torch.float32) for t in (state.K, state.V))
        dq = None
        state.mode = "grad"
        for sl in tiles:  # pass 2: post-attention part and the attention's backward
            state.sl, state.calls = sl, 0
            x_tile = x.detach()[:, sl].requires_grad_(x.requires_grad)
            y = call_tile(run, x_tile, sl)
            q_leaf, k_leaf, v_leaf, out, o_leaf = state.saved
            state.saved = None
            backward_pairs([(y, g[:, sl])])  # o_proj, MLP, norms, residual
            go = o_leaf.grad if o_leaf.grad is not None else torch.zeros_like(o_leaf)  # every rank joins the a2a
            dqh, dk, dv = torch.autograd.grad(out, (q_leaf, k_leaf, v_leaf), state.to_heads(go.transpose(1, 2)))
            state.dK += dk
            state.dV += dv
            del out, dk, dv, o_leaf
            q_tile = state.to_tokens(dqh)
            dq = q_tile.new_zeros(*q_tile.shape[:2], x.shape[1], q_tile.shape[3]) if dq is None else dq
            dq[:, :, sl] = q_tile
            if dx is not None and x_tile.grad is not None:
                dx[:, sl] += x_tile.grad
        state.mode = "pre"
        for sl in tiles:  # pass 3: dK, dV complete; the pre-attention part's backward
            state.sl, state.calls = sl, 0
            x_tile = x.detach()[:, sl].requires_grad_(x.requires_grad)
            with contextlib.suppress(StopTile):
                call_tile(run, x_tile, sl)
            q, k, v = state.pre
            state.pre = None
            dk, dv = state.kv_grads()
            backward_pairs([(q, dq[:, :, sl].to(q.dtype)), (k, dk.to(k.dtype)), (v, dv.to(v.dtype))])
            if dx is not None and x_tile.grad is not None:
                dx[:, sl] += x_tile.grad
    add_input_grad(x, dx)


class UlyssesTiles:
    """The shard tiler `grpo_accel.tiling.layer.shard_tiles` hands each tiled layer of an SP group's forward."""

    def __init__(self, group):
        self.group = group

    def forward(self, run, x: torch.Tensor, tiles) -> torch.Tensor:
        return forward(run, x, tiles, self.group)

    def backward(self, run, x: torch.Tensor, g: torch.Tensor, tiles) -> None:
        return backward(run, x, g, tiles, self.group)
