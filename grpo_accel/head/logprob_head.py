"""Put our fused log-prob head on an HF causal LM, reachable through any wrapper (PEFT, DDP, DeepSpeed).

`install_logprob_head(model)` patches the causal LM's forward on that instance: a call with
`accel_labels=labels` runs the backbone, then `token_logprobs` on the hidden states of the labelled
positions only, and returns `log_probs` / `entropy` [B, T] (0 where the label is -100); with
`accel_kept_mass=Truncation(...)` also `log_kept_mass` [B, T], no grad (ops/truncation.py: the mass the full
tempered distribution puts on a truncating sampler's support). Every other call
goes to the previous forward untouched (generation, TRL's own `fused_lm_head=True` path).

Why through the model's forward and not by calling the backbone from the trainer: wrappers (DDP's
reducer, DeepSpeed's engine, ZeRO-3's pre-forward hooks) must see a forward to arm their backward.

Under DeepSpeed ZeRO-3 the head's weight is partitioned and only gathered inside the lm_head module's
own forward; we read it directly, so it is gathered for our forward and again for the backward
recompute (`weight_ctx`). With tied embeddings it is usually still gathered from the embedding.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from grpo_accel.core.model_access import causal_lm_of, zero3_gather_ctx
from grpo_accel.core.patches import set_attr
from grpo_accel.offload import offload_saved_tensors
from grpo_accel.ops.select import token_logprobs
from grpo_accel.ops.truncation import log_kept_mass


@dataclass
class HeadOutput(ModelOutput):  # a ModelOutput, so ZeRO-3's hooks can see the tensors inside
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    router_logits: tuple | None = None  # a MoE model's, per router call, when the call asked output_router_logits
    log_kept_mass: torch.Tensor | None = None  # log Z of a truncating sampler's support, when the call asked it


def head_unsupported_reason(causal_lm) -> str | None:
    """Our head computes softcap(h @ W) / T. Models with a head bias or a logit scale need TRL's."""
    cfg = causal_lm.config.get_text_config()
    head = causal_lm.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        return "the model has no linear output embedding"
    if getattr(head, "bias", None) is not None:
        return "the LM head has a bias"
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            return f"the config scales logits ({name})"
    return None


def install_logprob_head(model, *, temperature: float, impl: str = "auto", chunk_size: int | None = None,
                         vocab_tile: int | None = None, offload=None, labels_kwarg: str = "accel_labels",
                         shift: bool = True):
    """Returns the undo (the causal LM's forward as before). `offload`: an OffloadConfig to hold the head's saved
    hidden states (G·T·H, the largest tensor the head keeps for backward) in host memory between the policy forward
    and the head's backward; None keeps them. A call with `labels_kwarg` runs the backbone and the head; `shift`:
    the labels are the input ids (the next-token shift happens here, TRL's convention); without it they are targets
    already aligned with the positions (an SP shard's: a shift inside the shard would lose its last target). Other
    calls (generation, TRL's `fused_lm_head`, another head's kwarg) go to the previous forward untouched."""
    causal_lm = causal_lm_of(model)
    reason = head_unsupported_reason(causal_lm)
    if reason:
        raise ValueError(f"grpo_accel's log-prob head does not support this model: {reason}. Fix: logprob_impl='trl'.")
    previous = causal_lm.forward
    softcap = getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None)

    @functools.wraps(previous)  # __wrapped__: generate() validates kwargs against the original signature
    def forward(*args, **kwargs):
        labels = kwargs.pop(labels_kwarg, None)
        if labels is None:
            return previous(*args, **kwargs)
        entropy = kwargs.pop("accel_entropy", False)
        truncation = kwargs.pop("accel_kept_mass", None)
        router = kwargs.get("output_router_logits")
        out = backbone_output(causal_lm, args, kwargs)
        hidden = out.last_hidden_state
        if shift:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        scored = score_hidden(causal_lm, hidden, labels, impl=impl, temperature=temperature, softcap=softcap,
                              compute_entropy=entropy, chunk_size=chunk_size, vocab_tile=vocab_tile, offload=offload,
                              truncation=truncation)
        if router:
            scored.router_logits = out.router_logits
        return scored

    forward.accel_labels_kwarg = labels_kwarg
    return set_attr(causal_lm, "forward", forward)


def backbone_output(causal_lm, args, kwargs):
    """The backbone's output (last hidden states [B, T, H]; a MoE's router logits when asked) for a forward call's
    arguments, without the LM head."""
    kwargs["use_cache"] = False
    for key in ("labels", "return_dict", "logits_to_keep", "num_items_in_batch"):  # PEFT passes these as None
        kwargs.pop(key, None)
    return causal_lm.base_model(*args, **kwargs)


def backbone_hidden(causal_lm, args, kwargs):
    """The backbone's last hidden states [B, T, H] for a forward call's arguments, without the LM head."""
    return backbone_output(causal_lm, args, kwargs).last_hidden_state


def score_hidden(causal_lm, hidden, labels, *, impl, temperature, softcap, compute_entropy, chunk_size, vocab_tile,
                 offload, truncation=None) -> HeadOutput:
    """Log-probs (and entropies) of `labels` [B, T] (aligned with `hidden`'s positions, -100 = unscored) through
    the fused head, scattered back to [B, T]; `offload` holds the head's saved hidden states in host memory;
    `truncation` (a Truncation that is on): also log Z of its support at each scored position, no grad."""
    labels = labels.to(hidden.device)
    mask = labels != -100
    weight = causal_lm.get_output_embeddings().weight
    keep_on_host = (offload_saved_tensors(min_bytes=offload.min_bytes, config=offload) if offload is not None
                    else nullcontext())
    with zero3_gather_ctx(weight), keep_on_host:
        logp, ent = token_logprobs(hidden[mask], weight, labels[mask], impl=impl, temperature=temperature,
                                   softcap=softcap, compute_entropy=compute_entropy, chunk_size=chunk_size,
                                   vocab_tile=vocab_tile, weight_ctx=lambda: zero3_gather_ctx(weight))
        log_z = (log_kept_mass(hidden[mask], weight, truncation, temperature=temperature, softcap=softcap)
                 if truncation is not None and truncation.on else None)
    # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero)
    scatter = lambda x: None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)  # noqa: E731
    return HeadOutput(log_probs=scatter(logp), entropy=scatter(ent), log_kept_mass=scatter(log_z))
