"""Routing replay for mixture-of-experts models: each token goes to the experts the sampler chose for it.

Naive equivalent: in every MoE layer, `router_indices = recorded[token, layer]` in place of the router's own
`torch.topk`, so the trainer's forward runs the experts that produced the sampled token. Without it an engine and a
trainer pick different experts for ~10% of (token, layer) routings on Qwen3-30B-A3B, and the policy ratio then
measures two different networks (Megatron-LM#4168: 3 of 3 GRPO runs collapsed without replay, 0 of 3 with).

The variant is R3 (rollout routing replay): the experts are the *sampler's*, recorded during generation; the gate
weights are recomputed from the *current* router's logits at those experts, by the model's own rule (Qwen3-MoE:
softmax over all experts, gather, renormalise; gpt-oss: gather the logits, softmax over the top-k). So the router
keeps its gradient through the gate weights and its logits (TRL's load-balancing loss reads those, unchanged), and
replaying the router's own choice is bit-identical to no replay: topk's values are exactly the gathered ones.
R2 (GSPO's routing replay) would replay the old policy's routing as the trainer computed it: it fixes the
trainer's old-vs-current drift but leaves the sampler-vs-trainer mismatch, which is the larger one off-policy
(a carried token was routed by an older router in another engine); R3 fixes both, and needs only what the
sampler already computed.

The hook sits at the smallest point: each router module's forward (the line with `torch.topk`), wrapped per
instance; each MoE layer's attention forward is wrapped to hand its router the routing of this forward. A
forward's routing travels as the model keyword `routed_experts=ForwardRouting(...)`, which transformers passes to
every decoder layer and on to its attention, and which gradient checkpointing binds into the re-run's call (torch's
checkpoint and our offloaded one alike): the backward re-run routes exactly as the forward did. Cost: one gather
and a softmax over [tokens, E] per layer (the router already computes it), and the record, int16 [tokens, layers,
top-k] on the host.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from grpo_accel.core.patches import Patches, set_attr

ROUTING_KWARG = "routed_experts"


def _qwen3_moe_gates(router, logits, idx):
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    gates = probs.gather(-1, idx)
    if router.norm_topk_prob:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(logits.dtype)


def _gpt_oss_gates(router, logits, idx):
    top = logits.gather(-1, idx)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


# router class -> gate weights at given experts, by that model's own rule (transformers 5.24's forward)
GATES = {"Qwen3MoeTopKRouter": _qwen3_moe_gates, "GptOssTopKRouter": _gpt_oss_gates}


@dataclass
class ForwardRouting:
    """One forward's recorded routing: `indices` [B, T, L, k] (L: the model's MoE layers in order), -1 where a token
    has no record (it keeps the router's own choice). `replay` False: only measure how many routings differ."""

    indices: torch.Tensor
    replay: bool = True


class RoutingReplay:
    """The routers of one model, patched while installed (`install()` returns the undo), and what they measured:
    (token, layer) routings compared with a record (`compared`), how many the router's own top-k would route
    elsewhere (`flipped`), how many were routed elsewhere than recorded (`applied_flips`: 0 with replay)."""

    def __init__(self, causal_lm, replaying: bool = True):
        self.replaying = replaying  # False: the routers keep their own top-k, the records only measure the mismatch
        self.layers = _moe_layers(causal_lm)
        self._active: dict[int, tuple[torch.Tensor, bool]] = {}
        self._recording: dict[int, list[torch.Tensor]] | None = None
        self.compared = self.flipped = self.applied_flips = 0

    @staticmethod
    def unsupported_reason(causal_lm) -> str | None:
        """Why this model cannot replay routing (None: it can; a dense model has nothing to replay)."""
        routers = {type(r).__name__ for _, r in _moe_layers(causal_lm, strict=False)}
        unknown = sorted(routers - set(GATES))
        if unknown:
            return f"routing replay knows the routers of {sorted(GATES)}, not {unknown}"
        return None if routers else "a dense model routes nothing"

    def install(self) -> Patches:
        patches = Patches()
        for number, (layer, router) in enumerate(self.layers):
            attention = layer.self_attn
            patches.add(set_attr(attention, "forward", self._attention_forward(attention.forward, number, router)))
            patches.add(set_attr(router, "forward", self._router_forward(router, router.forward, number)))
        return patches

    @contextlib.contextmanager
    def recording(self):
        """Collects each router call's own top-k while open: yields {MoE layer number: [[rows, k], ...]} in call
        order (generation: one entry per forward step; a whole forward: one per layer)."""
        self._recording = {number: [] for number in range(len(self.layers))}
        try:
            yield self._recording
        finally:
            self._recording = None

    def own_routing(self, causal_lm, **inputs) -> torch.Tensor:
        """[B, T, L, k] the experts the model's own forward picks for `inputs` (no grad): a record that replays
        to exactly the stock forward."""
        with torch.no_grad(), self.recording() as calls:
            causal_lm(**inputs)
        B, T = inputs["input_ids"].shape
        return torch.stack([torch.cat(calls[n]).reshape(B, T, -1) for n in sorted(calls)], dim=2)

    def pop_counts(self) -> tuple[int, int, int]:
        counts = (self.compared, self.flipped, self.applied_flips)
        self.compared = self.flipped = self.applied_flips = 0
        return counts

    def _attention_forward(self, original, number: int, router):
        # transformers 5.24 checkpoints the decoder layer's class forward, so a wrapper of the layer runs outside the
        # checkpoint and its re-run would route unreplayed; the attention inside it is handed the layer's keywords,
        # ours included, in the forward and in the re-run alike, just before the MLP whose router reads them.
        @functools.wraps(original)
        def forward(*args, **kwargs):
            routing = kwargs.pop(ROUTING_KWARG, None)
            if routing is not None:
                self._active[id(router)] = (routing.indices[:, :, number], routing.replay)
            return original(*args, **kwargs)

        return forward

    def _router_forward(self, router, original, number: int):
        gates = GATES[type(router).__name__]

        @functools.wraps(original)
        def forward(hidden_states):
            logits, scores, own = original(hidden_states)
            if self._recording is not None:
                self._recording[number].append(own.detach())
            active = self._active.pop(id(router), None)
            if active is None:
                return logits, scores, own
            recorded, replay = active
            recorded = recorded.reshape(own.shape).to(own.device, torch.long)  # [B*T, k], rows as the router's
            has = recorded[:, :1] >= 0  # a token without a record keeps its own choice
            idx = torch.where(has, recorded, own)
            self._count(own, idx, has, replay)
            if not replay:
                return logits, scores, own
            return logits, gates(router, logits, idx), idx

        return forward

    def _count(self, own, recorded, has, replay: bool) -> None:
        # a routing differs when its set of experts differs (the order of the top-k changes nothing it computes)
        differ = (own.sort(-1).values != recorded.sort(-1).values).any(-1, keepdim=True) & has
        n_differ, n = int(differ.sum()), int(has.sum())
        self.compared += n
        self.flipped += n_differ
        self.applied_flips += 0 if replay else n_differ


def _moe_layers(causal_lm, strict: bool = True):
    """(decoder layer, its router) for each MoE layer, in order. strict: only routers this module knows."""
    base = getattr(causal_lm, "model", causal_lm)
    out = []
    for layer in getattr(base, "layers", ()):
        mlp = getattr(layer, "mlp", None)
        router = getattr(mlp, "router", None)
        router = getattr(mlp, "gate", None) if router is None else router
        if router is None or not hasattr(router, "top_k"):
            continue
        if strict and type(router).__name__ not in GATES:
            raise ValueError(f"routing replay: no gate rule for {type(router).__name__}")
        out.append((layer, router))
    return out


def moe_shape(causal_lm) -> tuple[int, int]:
    """(MoE layers, experts per token) of a model: the record's per-token shape."""
    layers = _moe_layers(causal_lm, strict=False)
    return len(layers), (layers[0][1].top_k if layers else 0)


class RoutingRecords:
    """The recorded routing of the sequences one generation batch produced, keyed by their real token ids (prompt +
    completion): TRL shuffles and splits a generation batch into micro-batches, and a row's tokens are what it
    carries through, so a row finds its routing wherever it lands (two rows with the same tokens are one sequence:
    either record serves). `found` / `missing`: rows of the passes since the last `pop_rows` with / without one."""

    def __init__(self):
        self._by_tokens: dict[tuple[int, ...], torch.Tensor] = {}
        self.found = self.missing = 0

    def replace(self, records: dict[tuple[int, ...], torch.Tensor]) -> None:
        """This generation batch's records ([n tokens, L, k] int, -1 where a token has none) in place of the last."""
        self._by_tokens = dict(records)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._by_tokens.values())

    def for_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """[B, T, L, k] the rows' recorded routing at their real tokens, -1 elsewhere; None when no row has one."""
        if not self._by_tokens:
            return None
        shape = next(iter(self._by_tokens.values())).shape[1:]
        out = torch.full((*input_ids.shape, *shape), -1, dtype=torch.int16)
        real, found = attention_mask.bool().cpu(), 0
        for b, (ids, keep) in enumerate(zip(input_ids.cpu(), real)):
            record = self._by_tokens.get(tuple(ids[keep].tolist()))
            if record is not None:
                out[b, keep] = record.to(torch.int16)
                found += 1
        self.found += found
        self.missing += input_ids.size(0) - found
        return out if found else None

    def pop_rows(self) -> tuple[int, int]:
        rows = (self.found, self.missing)
        self.found = self.missing = 0
        return rows
