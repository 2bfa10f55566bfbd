"""Sequence-tiled layer: a decoder layer over one long row, `OffloadConfig.recompute_tokens` tokens at a time.

Naive equivalent: `layer(x)` on [B, T, H] and, in backward, one re-run of the whole layer, whose saved tensors
(~53 KB per token for SmolLM2-135M in fp32, ~230 KB for Llama-3.1-8B in bf16) all exist at once: 33 GiB for one
110K-token Qwen3-8B row. A row cannot be split into row groups, so this splits it along the sequence.

Everything in a decoder layer but attention is token-local (norms, q/k/v/o projections, RoPE, MLP, LoRA, their
dropout), so it runs on a tile of tokens; attention runs per *query* tile against the keys and values up to that
tile's end (causal, lower-right aligned), so nothing holds a T x T score matrix. The cut is HF's attention
interface (`ALL_ATTENTION_FUNCTIONS.get_interface`), routed through `_Tiling.hook` while a tiled call runs.

Forward (no grad, one pass): tile by tile, the hook stores the tile's keys and values into full-length K, V
[B, kv_heads, T, d] and attends the tile's queries to K[:e], V[:e].
Backward (re-run, two passes): 1) no grad, tile by tile up to the attention: K, V again (the rest of the layer is
skipped by raising `StopTile` in the hook); 2) last tile first, with grad: the tile's layer, backward of its output
(post-attention part, parameter grads accumulate), backward of its attention (dq of the tile, dK / dV of every
key up to the tile's end, accumulated in fp32), then backward of its q/k/v (pre-attention part). Going last tile
first, a tile's dK / dV are complete when its own q/k/v backward runs.

Cost: one more forward of the pre-attention part (norm + q/k/v projections, ~11% of an 8B layer's linear FLOPs
forward, ~4% of its forward + backward); full-length tensors left in the re-run: x, d(out), d(x) [H each], K, V and
fp32 dK, dV [kv_dim each] per token, instead of the whole layer's saved tensors. Dropout: each tile's RNG state is
recorded in the forward and replayed, so the re-run draws the forward's masks (the masks differ from an untiled
layer's: a tiled layer is its own, exactly differentiated, function). Ulysses SP shards: parallel/ulysses_tiles.py
(the same tiles, keys from the other ranks). gpt-oss's sinks and sliding windows: tiling/attention.py (a sliding
tile's keys start where its window does; the sink joins the query inside the layer's graph, so d(sink) comes back
through the tile's q backward). Not tiled (whole re-run instead): attention other than sdpa / eager (flash
varlen reads packed sequences from position ids; grpo_accel.parallel.packing's segments), calls this hook does not
understand (soft-capping, caches, BlockMasks, 2-D masks), ZeRO-3 partitions (each tile would gather them again),
rows of <= the tile. Several processes (DDP, ZeRO-1/2): tiled, each parameter's grad
summed over the tiles and returned once by the checkpoint Function (rerun.param_aliases).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from grpo_accel.core import rng as rng_state
from grpo_accel.tiling.attention import PACKED_ATTN, SEGMENTS_KWARG, attend_tile, with_sink_column

# attention-interface kwargs a tiled call may ignore; any other kwarg with a value makes the layer untileable
_IGNORED_KWARGS = {"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values"}
_MUST_BE_NONE = {"sliding_window", "softcap", "s_aux", "sinks"}
GPT_OSS_KWARGS = ("sliding_window", "s_aux")  # what `attend_tile` runs (tiling/attention.py): here and in Ulysses'
# implementations whose result SDPA with the same mask reproduces; grpo_accel.parallel.packing's packed attention
# (`accel_segments`, no mask) is reproduced segment by segment
_SAME_AS_SDPA = ("sdpa", "eager", None, PACKED_ATTN)


class Untileable(Exception):
    """The layer's attention call is not one the tiled path reproduces; the caller runs the layer whole."""


class StopTile(Exception):
    """Raised by the hook in the key/value pass: the rest of the layer is not needed."""


@contextlib.contextmanager
def attention_hook(hook):
    """Every HF attention-interface lookup returns `partial(hook, name)` (instance attribute over the method)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    registry.get_interface = lambda impl, default: functools.partial(hook, impl)
    try:
        yield
    finally:
        registry.__dict__.pop("get_interface", None)


def unsupported_attention(impl, module, kwargs, allow=()) -> list[str]:
    """What in one attention-interface call the tiled paths do not reproduce (empty: they reproduce it): kwargs
    with values beyond the ignorable ones and `allow`, the ones that must be None, an implementation other than
    SDPA's result, a non-causal module. One list for this module's hook and parallel/ulysses_tiles.py's."""
    bad = [k for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS and k not in allow
           and not (k == "is_causal" and v)] + [k for k in _MUST_BE_NONE - set(allow) if kwargs.get(k) is not None]
    if impl not in _SAME_AS_SDPA:  # flash varlen reads packed sequences from position ids; custom ones: unknown
        bad.append(f"attn_implementation={impl!r}")
    if not getattr(module, "is_causal", True):
        bad.append("a non-causal attention module")
    return bad


class _Tiling:
    """One tiled call: full-length K, V, the current tile `sl`, and what the hook does ("forward", "kv", "grad")."""

    def __init__(self, T: int, mode: str):
        self.T, self.mode, self.sl, self.calls = T, mode, None, 0
        self.K = self.V = self.dK = self.dV = None
        self.saved = None  # "grad" mode: (q, k, v with their graphs, q leaf, K/V leaves, attention output, o leaf)

    def hook(self, impl, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        self.calls += 1
        segments = kwargs.pop(SEGMENTS_KWARG, None) if impl == PACKED_ATTN else None
        bad = unsupported_attention(impl, module, kwargs, allow=GPT_OSS_KWARGS)
        if bad or self.calls > 1 or query.shape[2] != self.sl.stop - self.sl.start or key.shape[2] != query.shape[2]:
            raise Untileable(f"attention call with {bad or 'an unexpected shape'}")
        s, e = self.sl.start, self.sl.stop
        window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
        if sinks is not None:  # in the layer's graph: the "grad" pass's q backward carries d(sinks)
            query = with_sink_column(query, sinks, scaling)
        extras = (window, sinks is not None)
        if self.mode != "grad":  # the forward and the key/value pass fill K, V
            if self.K is None:
                self.K = key.new_empty(*key.shape[:2], self.T, key.shape[3])
                self.V = value.new_empty(*value.shape[:2], self.T, value.shape[3])
            self.K[:, :, s:e], self.V[:, :, s:e] = key, value
            if self.mode == "kv":
                raise StopTile
            out = attend_tile(query, self.K[:, :, :e], self.V[:, :, :e], attention_mask, s, dropout, scaling, segments,
                          *extras)
            return out.transpose(1, 2), None
        q_leaf = query.detach().requires_grad_()
        k_leaf = self.K[:, :, :e].detach().requires_grad_()
        v_leaf = self.V[:, :, :e].detach().requires_grad_()
        out = attend_tile(q_leaf, k_leaf, v_leaf, attention_mask, s, dropout, scaling, segments, *extras)
        o_leaf = out.detach().transpose(1, 2).requires_grad_()
        self.saved = (query, key, value, q_leaf, k_leaf, v_leaf, out, o_leaf)
        return o_leaf, None


_SHARD = contextvars.ContextVar("grpo_accel_shard_tiles", default=None)


@contextlib.contextmanager
def shard_tiles(tiler):
    """Forwards inside run on sequence shards whose attention needs keys other ranks hold: their tiles go through
    `tiler.forward(run, x, tiles)` / `tiler.backward(run, x, g, tiles)` (grpo_accel.parallel.ulysses_tiles.
    UlyssesTiles). Handed in, not imported: tiling sits below parallel."""
    token = _SHARD.set(tiler)
    try:
        yield
    finally:
        _SHARD.reset(token)


def current_shard():
    """The shard tiler of the enclosing `shard_tiles`, or None (a whole sequence on this rank)."""
    return _SHARD.get()


def seq_tiles(function, args, kwargs, recompute_tokens: int | None, module) -> list[slice] | None:
    """Tiles of <= recompute_tokens tokens along dim 1 when `function` is a HF decoder layer called on one long
    [B, T, H] input (`layer(x, **bound)` as GradientCheckpointingLayer calls it); None = run it whole."""
    if (not recompute_tokens or not isinstance(function, functools.partial) or len(args) != 1
            or kwargs or not isinstance(args[0], torch.Tensor) or module is None or not hasattr(module, "self_attn")):
        return None
    x, bound = args[0], function.keywords
    if x.ndim != 3 or not x.is_floating_point() or x.shape[1] <= recompute_tokens:
        return None
    T = x.shape[1]
    rope, mask = bound.get("position_embeddings"), bound.get("attention_mask")
    if not (isinstance(rope, tuple) and all(isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[1] == T
                                            for t in rope)):
        return None  # RoPE computed inside the layer from position ids: not sliced here
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.shape[-2:] == (T, T)):
        return None
    if bound.get("past_key_values") is not None:
        return None
    return [slice(s, min(s + recompute_tokens, T)) for s in range(0, T, recompute_tokens)]


def call_tile(run, x_tile, sl: slice):
    """The layer on one tile: RoPE tables sliced to the tile; the mask stays whole (the hook slices it)."""
    bound = dict(run.keywords)
    bound["position_embeddings"] = tuple(t[:, sl] for t in bound["position_embeddings"])
    return run.func(*run.args, x_tile, **bound)


def set_rng(states, i: int) -> None:
    """Tile i's recorded RNG state back (no-op without a record: no live dropout)."""
    if states:
        rng_state.restore(states[i])


def forward(run, x: torch.Tensor, tiles: list[slice], record_rng: bool, shard=None):
    """(output, per-tile RNG states or None) of the layer run tile by tile under no_grad. Raises Untileable before
    anything is written when the first tile's attention call is not one this path reproduces. `shard`: x is a
    sequence shard run by that tiler (`current_shard()`; live dropout is not replayed there: Untileable)."""
    if shard is not None:
        if record_rng:
            raise Untileable("live dropout on a sequence shard")
        return shard.forward(run, x, tiles), None
    state, rng = _Tiling(x.shape[1], "forward"), [] if record_rng else None
    y = None
    with attention_hook(state.hook):
        for sl in tiles:
            if rng is not None:
                rng.append(rng_state.capture(x))
            y = forward_tile(state, run, x, sl, y)
    return y, rng


def forward_tile(state, run, x: torch.Tensor, sl: slice, y: torch.Tensor | None) -> torch.Tensor:
    """The layer on tile `sl` of x written into y (allocated like x on the first tile), through `state`'s hook
    (this module's or parallel/ulysses_tiles.py's); Untileable when the layer did not call attention once and return
    one tensor."""
    state.sl, state.calls = sl, 0
    out = call_tile(run, x[:, sl], sl)
    if state.calls != 1 or not isinstance(out, torch.Tensor) or out.shape != x[:, sl].shape:
        raise Untileable("the layer did not call attention once and return one [B, T, H] tensor")
    y = x.new_empty(x.shape) if y is None else y
    y[:, sl] = out
    return y


def backward(run, x: torch.Tensor, g: torch.Tensor, tiles: list[slice], rng, shard=None) -> None:
    """Re-run the layer tile by tile with grad and back-propagate `g` (see the module docstring); parameter grads
    accumulate, `x.grad` gets d(x) when x requires grad. Call under the forward's autocast / RNG replay."""
    if shard is not None:
        return shard.backward(run, x, g, tiles)
    state = _Tiling(x.shape[1], "kv")
    dx = torch.zeros_like(x) if x.requires_grad else None
    with attention_hook(state.hook):
        kv_pass(state, run, x, tiles, rng)  # pass 1: keys and values of every tile
        # fp32 accumulators: dK[:e] collects one term per query tile at or after the key tile (2 * T * kv_dim * 4 B)
        state.dK, state.dV = (torch.zeros_like(t, dtype=torch.float32) for t in (state.K, state.V))
        state.mode = "grad"
        for i, sl in reversed(list(enumerate(tiles))):  # pass 2: last tile first
            set_rng(rng, i)
            state.sl, state.calls = sl, 0
            x_tile = x.detach()[:, sl].requires_grad_(x.requires_grad)
            y = call_tile(run, x_tile, sl)
            q, k, v, q_leaf, k_leaf, v_leaf, out, o_leaf = state.saved
            state.saved = None
            backward_pairs([(y, g[:, sl])])  # post-attention part: o_proj, MLP, norms, residuals
            if o_leaf.grad is None:
                continue
            dq, dk, dv = torch.autograd.grad(out, (q_leaf, k_leaf, v_leaf), o_leaf.grad.transpose(1, 2))
            e = sl.stop
            state.dK[:, :, :e] += dk
            state.dV[:, :, :e] += dv
            del out, dk, dv, o_leaf
            backward_pairs([(q, dq), (k, state.dK[:, :, sl].to(k.dtype)), (v, state.dV[:, :, sl].to(v.dtype))])
            if dx is not None and x_tile.grad is not None:
                dx[:, sl] = x_tile.grad
    add_input_grad(x, dx)


def kv_pass(state, run, x: torch.Tensor, tiles: list[slice], rng=None) -> None:
    """A re-run's first pass: every tile up to its attention call under no_grad, replaying tile i's RNG state when
    recorded; the state's hook ("kv" mode) stores the keys and values and stops the layer there (StopTile)."""
    state.mode = "kv"
    with torch.no_grad():
        for i, sl in enumerate(tiles):
            set_rng(rng, i)
            state.sl, state.calls = sl, 0
            with contextlib.suppress(StopTile):
                call_tile(run, x.detach()[:, sl], sl)


def add_input_grad(x: torch.Tensor, dx: torch.Tensor | None) -> None:
    """A tiled re-run's d(x), gathered tile by tile, added to x.grad (the checkpoint Function returns it)."""
    if dx is not None:
        x.grad = dx if x.grad is None else x.grad + dx


def backward_pairs(pairs) -> None:
    pairs = [(t, g) for t, g in pairs if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
