"""Each prompt once per group: the shared-prompt layout for the policy, old and reference log-prob passes.

Naive equivalent: padding-free packing (packing.py) puts each of a group's G rows in the packed row whole, so the
prompt's P tokens go through every layer G times. Here the rows that share a prompt become one stretch of the
packed row:

    [p_0 .. p_{P-2}] [p_{P-1} c1_0 .. c1_n1] [p_{P-1} c2_0 .. c2_n2] ... [p_{P-1} cG_0 .. cG_nG]
     prefix, once     segment 1               segment 2                   segment G

The prefix attends causally to itself. Each segment attends to the whole prefix and causally to itself, never to
its siblings (tiling/attention.py's `Segment` with a prefix: the keys [prefix ; own] under a lower-right causal
mask), and its positions continue from the prompt's end (RoPE sees what it sees unshared). The prompt's last token
starts every segment: its hidden state is the unshared row's (it sees the prefix and itself), and the head's usual
shift (position p-1 scores token p) scores each completion's first token from it; the copies cost G - 1 tokens.
Gradients are exact by construction: the prefix's keys and values feed every segment's attention, so autograd sums
the G completions' gradients into the one prefix, as the unshared rows' sum would.

What it saves, per group: G * (P + C) tokens become P - 1 + G * (C + 1) in every token-local part of the model
(norms, projections, MLP, LoRA, the saved activations), and the attention scores fall from G * (P + C)^2 / 2 to
P^2 / 2 + G * (C + 1) * (P + C). What it costs: one attention call per segment plus the prefix's (packing makes one
per sequence too), and a copy of the prefix's keys and values per segment and layer (transient).
Not exact under live dropout: the prefix draws one dropout mask where the unshared rows draw G (GRPO runs usually
disable dropout; TRL's `disable_dropout`).

`share_prompt="auto"` shares a group when sharing removes at least a quarter of its tokens (the planner's rule,
grpo_accel.core.settings.share_prompt_pays): a short prompt beside long completions stays on the packed path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_accel.core.settings import share_prompt_pays, shared_group_tokens
from grpo_accel.parallel.packing import PackedRows
from grpo_accel.tiling.attention import Segment


@dataclass
class Unit:
    """Rows packed together: sharing their prompt (`share`) or each row whole."""
    rows: list[int]
    share: bool

    def tokens(self, prompt_len: int, lengths: list[int]) -> int:
        """Tokens this unit puts in a packed row (`lengths`: each row's real tokens, prompt included)."""
        if not self.share:
            return sum(lengths[r] for r in self.rows)
        return shared_group_tokens(prompt_len, [lengths[r] - prompt_len for r in self.rows])


def prompt_units(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 mode: str) -> tuple[list[Unit], list[int]]:
    """(units, each row's prompt length): the batch's rows grouped by identical prompt tokens (TRL's layout: the
    left-padded prompt in the first T - logits_to_keep columns), in first-seen order, each group shared or not."""
    cut = input_ids.size(1) - logits_to_keep
    prompt_mask = attention_mask[:, :cut].bool()
    prompt_lens = prompt_mask.sum(1).tolist()
    completion_lens = attention_mask[:, cut:].sum(1).tolist()
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(input_ids[:, :cut].tolist()):
        key = tuple(t for t, m in zip(row, prompt_mask[r].tolist(), strict=True) if m)
        groups.setdefault(key, []).append(r)
    units = []
    for rows in groups.values():
        if share_prompt_pays(prompt_lens[rows[0]], [completion_lens[r] for r in rows], mode):
            units.append(Unit(rows, share=True))
        else:
            units.extend(Unit([r], share=False) for r in rows)
    return units, prompt_lens


def split_units_to_count(forwards: list[list[Unit]], count: int) -> list[list[Unit]]:
    """As packing.split_to_count, for forwards of units: the forward with the most rows is halved (its units
    alternately; a lone shared unit's rows alternately, each half sharing the prompt) until there are `count`."""
    forwards = [list(f) for f in forwards]
    while len(forwards) < count:
        i = max(range(len(forwards)), key=lambda j: sum(len(u.rows) for u in forwards[j]))
        units = forwards.pop(i)
        if len(units) > 1:
            halves = [units[::2], units[1::2]]
        elif len(units[0].rows) > 1:
            rows = units[0].rows
            halves = [[Unit(rows[::2], units[0].share)], [Unit(rows[1::2], units[0].share)]]
        else:
            raise ValueError(f"cannot split {len(forwards) + 1} single-row forwards into {count}")
        forwards[i:i] = halves
    return forwards


def pack_units(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
               units: list[Unit]) -> PackedRows:
    """One packed row of `units` (module docstring's layout for shared ones, each row whole for the others), with
    where each scored token goes in TRL's flat [B * logits_to_keep] output; the same scored tokens as
    packing.pack_rows (the completion's real tokens, a row's very first token never)."""
    T, device = input_ids.size(1), input_ids.device
    cut = T - logits_to_keep
    ids, pos, labels, segments, src, dst = [], [], [], [], [], []
    n = 0  # tokens placed so far

    def place(tokens, first_pos, n_context, row, completion_cols, prefix=(0, 0)):
        """A segment: `n_context` unscored tokens, then the row's completion tokens (scored where position > 0)."""
        nonlocal n
        m = tokens.numel()
        positions = torch.arange(first_pos, first_pos + m, device=device)
        scored = torch.arange(m, device=device) >= n_context
        scored &= positions > 0
        ids.append(tokens)
        pos.append(positions)
        labels.append(torch.where(scored, tokens, torch.full_like(tokens, -100)))
        segments.append(Segment(n, n + m, *prefix))
        at = scored.nonzero().squeeze(1)
        src.append(n + at - 1)  # the head's output p - 1 scores token p
        dst.append(row * logits_to_keep + completion_cols[at - n_context] - cut)
        n += m

    for unit in units:
        first = unit.rows[0]
        prompt = input_ids[first, :cut][attention_mask[first, :cut].bool()]
        P = prompt.numel()
        prefix = (0, 0)
        if unit.share:
            place(prompt[:-1], 0, P - 1, first, torch.empty(0, dtype=torch.long, device=device))
            prefix = (n - (P - 1), n)
        for r in unit.rows:
            real = attention_mask[r, cut:].bool()
            cols = cut + real.nonzero().squeeze(1)
            head = prompt[-1:] if unit.share else prompt
            place(torch.cat([head, input_ids[r, cols]]), P - head.numel(), head.numel(), r, cols, prefix)
    ids, pos, labels = torch.cat(ids), torch.cat(pos), torch.cat(labels)
    if ids.numel() == 1:  # the head scores positions 0..N-2: give a lone token a partner (own segment, unscored)
        ids, pos, labels = ids.repeat(2), torch.cat([pos, pos]), torch.cat([labels, labels.new_full((1,), -100)])
        segments.append(Segment(1, 2))
    return PackedRows(ids[None], pos[None], labels[None], tuple(segments), torch.cat(src), torch.cat(dst))
