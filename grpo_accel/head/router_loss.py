"""A mixture-of-experts router's load-balancing loss over the log-prob pass's forwards, as TRL's own hook gets it.

Naive equivalent (TRL 1.16, trl/trainer/utils.py `_fused_forward`): one padded forward of the micro-batch with
`output_router_logits=True`, then Mixtral's `load_balancing_loss_func(router_logits, E, k, attention_mask)`: per
expert, the share of the real tokens' top-k picks times the mean router probability, over every layer and real
token. Both are token sums, so it does not care how the tokens were split across forwards, tiles or rows: here the
router logits of every forward of the pass are joined per layer and the loss is taken once. Each token is weighted
by how many rows of TRL's layout it stands for: 1 for a padded row's real tokens (0 for its padding), 1 in a packed
row, and G for a shared prompt's tokens that G completions read (grpo_accel.parallel.shared_prompt), so the loss is
TRL's exactly. Cost: the router logits of the pass ([tokens, E] per layer, fp32 softmax inside), as TRL keeps them.
"""

from __future__ import annotations

import torch


def token_weights(n_tokens: int, segments, device) -> torch.Tensor:
    """[n_tokens] rows of TRL's layout each token of a packed row stands for: 1, or the number of segments that
    read a prefix token (the prompt shared by G completions stands for G rows)."""
    weights = torch.ones(n_tokens, device=device)
    readers = torch.zeros(n_tokens, device=device)
    for seg in segments or ():
        if seg.prefix_end > seg.prefix_start:
            readers[seg.prefix_start:seg.prefix_end] += 1
    return torch.where(readers > 0, readers, weights)


def load_balancing_loss(causal_lm, pieces) -> torch.Tensor:
    """TRL's router loss from `pieces` = [(router_logits per layer of one forward, token weights [n])], the
    forwards of one log-prob pass. A forward whose layers ran in pieces (one router call per tile) is joined back
    to one [n, E] per layer first, by counting rows."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # the one TRL uses

    cfg = causal_lm.config.get_text_config()
    layers, weights = None, []
    for router_logits, w in pieces:
        joined = _per_layer(router_logits, w.numel())
        layers = [[t] for t in joined] if layers is None else [acc + [t] for acc, t in zip(layers, joined,
                                                                                         strict=True)]
        weights.append(w)
    gate_logits = tuple(torch.cat(per_layer) for per_layer in layers)
    return load_balancing_loss_func(gate_logits, cfg.num_experts, cfg.num_experts_per_tok, torch.cat(weights))


def _per_layer(router_logits, n_tokens: int) -> list[torch.Tensor]:
    joined, run, rows = [], [], 0
    for t in router_logits:
        run.append(t.reshape(-1, t.shape[-1]))
        rows += run[-1].shape[0]
        if rows == n_tokens:
            joined.append(torch.cat(run))
            run, rows = [], 0
    if run:
        raise ValueError(f"router logits of {rows} rows do not add up to forwards of {n_tokens} tokens")
    return joined
