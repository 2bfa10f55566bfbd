"""Padding-free, token-budget micro-batches for the policy, old and reference log-prob passes.

Naive equivalent: `model(input_ids[rows], attention_mask=attention_mask[rows])` on TRL's [B, T] layout
(prompts left-padded, completions right-padded), `batch_size` rows per forward. GRPO completions differ
widely in length, so most of that [B, T] block can be padding: every layer computes it and the head's
hidden states hold it. Here each forward gets one row of real tokens only, [1, N] with N = sum of the rows'
real lengths, with position ids restarting at 0 per sequence, and rows are grouped so that N stays under a
token budget (longest first) instead of a fixed row count. Log-probs and entropies are scattered back into
TRL's [B, logits_to_keep] layout, so TRL's loss (normalisation included, for every loss_type: it only
reads the returned [B, T] tensors and the masks) is unchanged.

How attention keeps sequences apart (measured, SmolLM2-135M shape, 8 rows, T=512, 46% real tokens, 1 CPU
thread, forward): padded 10.3 s; transformers' own packed path (positions restart, no mask -> a dense
[1, 1, N, N] boolean mask for SDPA) 5.9 s; SDPA run once per sequence 5.0 s, no N x N mask. So:
  sdpa                  `segment_sdpa`: our attention function, SDPA with is_causal per segment (cost:
                        one kernel call per sequence per layer; memory: no mask at all).
  eager (gpt-oss)       `segment_sdpa` too, its sinks and sliding windows per segment (tiling/attention.py); unpacked
                        calls (generation) keep gpt-oss's eager attention and mask.
  flash_attention_2/3   transformers' varlen path from the restarting position ids (not run here: no GPU).
  anything else         padded, with one log line saying why (other eager models, flex, sliding windows elsewhere,
                        no RoPE).
Gotcha: transformers only detects packed position ids when `use_cache=False` (a DynamicCache made by
use_cache=True silently turns the mask into one causal mask over all N tokens); our head sets it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass

import torch

from grpo_accel.core.patches import Patches, register, set_attr
from grpo_accel.tiling.attention import PACKED_ATTN as ATTN_NAME
from grpo_accel.tiling.attention import SEGMENTS_KWARG, Segment, attend_tile, segments_of, with_sink_column

NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")
# Models whose attention modules hand `sliding_window` (and gpt-oss its sinks, `s_aux`) to the attention function,
# which `segment_sdpa` then runs per segment (tiling/attention.py); their stock implementation is eager (gpt-oss
# has no SDPA path in transformers: the sinks), which unpacked calls (generation) keep. Tested: tests/test_moe.py.
SLIDING_KWARG_MODELS = ("gpt_oss",)
UNPACKED_ATTN = "_accel_unpacked_attn"  # config attribute: the implementation unpacked calls go to
# RoPE variants whose result depends only on relative positions within one call (dynamic / longrope pick
# their scaling from the longest position seen, which packing changes).
_ROPE_TYPES_OK = (None, "default", "linear", "llama3", "yarn")
_PACKED = contextvars.ContextVar("grpo_accel_packed", default=False)


def segment_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """As transformers' sdpa_attention_forward; with `accel_segments=(Segment, ...)` the one packed row is attended
    one segment at a time (causal within each, a shared prompt's prefix seen whole: tiling/attention.py), else it is
    stock SDPA (generation, padded)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        if getattr(module.config, UNPACKED_ATTN, "sdpa") == "eager":  # gpt-oss: its own eager (sinks)
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    if sinks is not None:
        query = with_sink_column(query, sinks, scaling)
    out = attend_tile(query, key, value, None, 0, dropout, scaling, segments, window, sinks is not None)
    return out.transpose(1, 2), None  # [1, N, heads, head_dim], as sdpa_attention_forward returns


def _segment_sdpa_mask(*args, **kwargs):
    """SDPA's mask (eager's for an eager model), except in a packed forward: `segment_sdpa` needs none, and the
    [1, 1, N, N] one costs N^2."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    if _PACKED.get():
        return None
    eager = getattr(kwargs.get("config"), UNPACKED_ATTN, "sdpa") == "eager"
    return (eager_mask if eager else sdpa_mask)(*args, **kwargs)


def packing_unsupported_reason(model_or_config) -> str | None:
    """Why this model's forward cannot take packed rows, or None. Takes a loaded model or, for checks before any
    weights load, its config (no attention implementation chosen yet reads as transformers' default, sdpa)."""
    cfg = getattr(model_or_config, "config", model_or_config).get_text_config()
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    sinks_model = getattr(cfg, "model_type", None) in SLIDING_KWARG_MODELS
    if impl not in ("sdpa", ATTN_NAME, *NATIVE_VARLEN) and not (impl == "eager" and sinks_model):
        return f"attention implementation {impl!r} has no packed path here (sdpa or flash_attention_2/3 do)"
    rope = getattr(cfg, "rope_parameters", None)
    if rope is None and getattr(cfg, "rope_theta", None) is None:
        return "the model has no rotary position embeddings (absolute positions would shift with left padding)"
    rope_types = {(r or {}).get("rope_type") for r in (rope.values() if _per_layer_type(rope) else [rope])}
    if not rope_types <= set(_ROPE_TYPES_OK):
        return f"rope_type {sorted(map(str, rope_types))} depends on the sequence length"
    # Models with layer_types (Qwen2/3, Gemma) say which layers slide; older ones (Mistral) only set sliding_window,
    # which SDPA's mask applies and `segment_sdpa`'s is_causal would not.
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and set(layer_types) != {"full_attention"} and not sinks_model:
        return f"layers with {sorted(set(layer_types) - {'full_attention'})} attention"
    if layer_types is None and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"a sliding attention window ({cfg.sliding_window} tokens)"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit softcapping (eager only)"
    return None


def _per_layer_type(rope) -> bool:
    return isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())


def enable_packed_attention(causal_lm) -> Patches:
    """Route an sdpa model's attention through `segment_sdpa` until the returned patches are undone (not per call:
    a checkpointed layer re-runs in backward with the same kwargs, after our forward returned). Unpacked calls stay
    stock SDPA; flash models unchanged. The registrations are process-wide, counted (patches.register)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    done = Patches()
    done.add(register(AttentionInterface._global_mapping, ATTN_NAME, segment_sdpa))
    done.add(register(type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping, ATTN_NAME, _segment_sdpa_mask))
    for cfg in {id(c): c for c in (causal_lm.config, causal_lm.config.get_text_config())}.values():
        impl = getattr(cfg, "_attn_implementation", None)
        if impl == "sdpa" or (impl == "eager" and getattr(cfg, "model_type", None) in SLIDING_KWARG_MODELS):
            done.add(set_attr(cfg, UNPACKED_ATTN, impl))
            done.add(set_attr(cfg, "_attn_implementation", ATTN_NAME))
    return done


@contextlib.contextmanager
def packed_forward_context():
    """Around one packed forward: `_segment_sdpa_mask` builds no mask inside it (the mask is made once, in the
    model's top-level forward; a checkpointed layer's re-run in backward gets the one bound at forward time)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def default_token_budget(rows_per_forward: int, seq_len: int, recompute_tokens: int | None = None) -> int:
    """Tokens per packed forward when the config leaves it unset: what the padded forward held
    (rows_per_forward x T), so a packed forward never holds more than the padded one did; capped at the
    offload's re-run group (its backward re-runs a layer on whole rows, and a packed batch is one row)."""
    budget = rows_per_forward * seq_len
    return min(budget, recompute_tokens) if recompute_tokens else budget


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Rows grouped longest first (first-fit decreasing) so each group's total length <= token_budget;
    a row longer than the budget gets a group of its own."""
    groups, totals = [], []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        n = lengths[row]
        fit = next((g for g, total in enumerate(totals) if total + n <= token_budget), None)
        if fit is None:
            groups.append([row])
            totals.append(n)
        else:
            groups[fit].append(row)
            totals[fit] += n
    return groups


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` split (the one with most rows, halved, each time) until there are `count`. With several processes
    every rank must run the same number of forwards: ZeRO-3 all-gathers parameters in each forward (and again for
    a checkpointed re-run) and DDP broadcasts buffers, so a rank with fewer forwards would hang the others. Each
    rank has the same rows, so `count` (the most forwards any rank planned) is never more than the rows."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        g = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[g]) < 2:
            raise ValueError(f"cannot split {len(groups)} single-row groups into {count}")
        rows = groups.pop(g)
        groups[g:g] = [rows[::2], rows[1::2]]  # rows are longest first: alternate for balanced halves
    return groups


@dataclass
class PackedRows:
    """One packed forward: inputs [1, N] and where its scored tokens go in the flat [B * logits_to_keep] output."""
    input_ids: torch.Tensor     # [1, N] real tokens of `rows`, concatenated
    position_ids: torch.Tensor  # [1, N] 0..n-1 per sequence
    labels: torch.Tensor        # [1, N] token ids where scored, -100 elsewhere (prompt, sequence starts)
    segments: tuple[Segment, ...]  # the sequences in the row (tiling/attention.py)
    src: torch.Tensor           # [S] index into the head's [N - 1] outputs (position p-1 scores token p)
    dst: torch.Tensor           # [S] index into the flat [B * logits_to_keep] output


def packable_lengths(attention_mask: torch.Tensor) -> tuple[list[int], bool]:
    """(real tokens per row, whether every row's real tokens are one non-empty block). Packing drops the
    padding, which keeps relative positions only when no row has a hole in the middle."""
    mask = attention_mask.bool()
    cols = torch.arange(mask.size(1), device=mask.device)
    first = torch.where(mask, cols, mask.size(1)).amin(1)
    last = torch.where(mask, cols, -1).amax(1)
    lengths = mask.sum(1)
    ok = ((last - first + 1 == lengths) & (lengths > 0)).all()
    return lengths.tolist(), bool(ok)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              rows: list[int]) -> PackedRows:
    """Pack `rows` of the padded [B, T] batch into one [1, N] row (rows with contiguous real tokens)."""
    T, k, device = input_ids.size(1), logits_to_keep, input_ids.device
    row_ids = torch.tensor(rows, device=device)
    real = attention_mask[row_ids].bool()
    r_idx, c_idx = real.nonzero(as_tuple=True)  # row-major: the packed order
    ids = input_ids[row_ids][real]
    lengths = real.sum(1)
    first_col = torch.where(real, torch.arange(T, device=device), T).amin(1)
    pos = c_idx - first_col[r_idx]
    scored = (c_idx >= T - k) & (pos > 0)  # the padded head never scores a row's first token either
    labels = torch.where(scored, ids, torch.full_like(ids, -100))
    src = scored.nonzero().squeeze(1) - 1
    dst = row_ids[r_idx[scored]] * k + (c_idx[scored] - (T - k))
    segments = segments_of(lengths.tolist())
    if ids.numel() == 1:  # the head scores positions 0..N-2: give a lone token a partner (own segment, unscored)
        ids, pos, labels = ids.repeat(2), torch.cat([pos, pos]), torch.cat([labels, labels.new_full((1,), -100)])
        segments = segments_of([1, 1])
    return PackedRows(ids[None], pos[None], labels[None], segments, src, dst)


def unpack(values: list[tuple[PackedRows, torch.Tensor]], rows: int, logits_to_keep: int) -> torch.Tensor:
    """[rows, logits_to_keep] with each packed forward's [1, N-1] outputs at their padded places, 0 elsewhere
    (as the padded head returns for unscored tokens); differentiable."""
    src = torch.cat([v[0, p.src] for p, v in values])
    dst = torch.cat([p.dst for p, _ in values])
    return src.new_zeros(rows * logits_to_keep).index_copy(0, dst, src).view(rows, logits_to_keep)
