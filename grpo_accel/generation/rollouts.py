"""Versioned rollouts: what a completion carries when it was sampled by an older policy, and which groups may train.

One record for both producers of off-policy completions: a generation server running ahead of training (issue 52:
the server samples step n+1's groups while the trainer trains step n) and partial rollouts carried across steps on one
device (issue 53: a completion paused when the step's generation budget runs out continues under the next weights).
In both, each token has the policy version that sampled it and its behaviour log-prob at sampling time (after
temperature, as vLLM's `--logprobs-mode processed_logprobs` reports it). The loss then corrects with importance
sampling exactly as TRL 1.16's GRPOTrainer does with vLLM (`vllm_importance_sampling_correction`: ratio
exp(old - behaviour) per token or per sequence, truncated or masked at its clip bounds), the behaviour log-probs fed
where TRL puts vLLM's (`sampling_per_token_logps`), not the current policy's.

    buffer = RolloutBuffer(num_generations=8, max_staleness=1)
    buffer.add(group)                       # a RolloutGroup, complete or not (partial ones carry on)
    ready, dropped = buffer.take(n_groups=2, version=step)

The staleness rule: a group enters a batch only when all G completions have ended (advantages need the whole group),
and only while version - (its oldest token's version) <= max_staleness; an older one is dropped and counted. Dropping
favours short completions (a long one is more likely to span versions): `dropped` reports the dropped groups'
completion lengths, so the bias is measured, not assumed (RolloutBuffer.stats).

How a producer hands these to TRL's own scoring and correction (its `_generate` tuple, the `use_vllm` gate):
docs/off-policy-rollouts.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from grpo_accel.planning.generation import record_bytes


@dataclass
class Rollout:
    """One completion as sampled: its tokens, each token's behaviour log-prob and the policy version that sampled it;
    on a MoE whose route records routing, `routed_experts`: int16 [prompt + completion tokens, MoE layers, top-k], the
    experts each position was routed to when the sampler computed it (-1: not yet, e.g. the last token)."""

    completion_ids: list[int] = field(default_factory=list)
    behaviour_logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # EOS or the completion limit: nothing more to sample
    routed_experts: torch.Tensor | None = None

    def extend(self, ids: list[int], logps: list[float], version: int, finished: bool,
               routed_experts: torch.Tensor | None = None) -> None:
        """Tokens sampled by policy `version` (a resumed completion continues under newer weights); `routed_experts`
        the route's routing of the whole sequence so far (`merge_routing`)."""
        if len(ids) != len(logps):
            raise ValueError(f"{len(ids)} tokens but {len(logps)} behaviour log-probs")
        if self.finished:
            raise ValueError("this completion has ended: nothing may be appended to it")
        if self.versions and version < self.versions[-1]:
            raise ValueError(f"policy version {version} after {self.versions[-1]}: versions only grow")
        self.completion_ids += list(ids)
        self.behaviour_logps += [float(x) for x in logps]
        self.versions += [int(version)] * len(ids)
        self.finished = finished
        if routed_experts is not None:
            self.routed_experts = merge_routing(self.routed_experts, routed_experts)

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None


def merge_routing(kept: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """`new` ([n, L, k], the sequence's routing from this round) with each position `kept` already has kept: a
    position's first routing is the one that sampled the token after it (a carried completion's prefix is prefilled
    again under newer weights, but its next tokens were sampled from the older routing)."""
    if kept is None:
        return new.clone()
    out = new.clone()
    n = min(len(kept), len(out))
    out[:n] = torch.where(kept[:n] >= 0, kept[:n], out[:n])
    return out


def within_staleness(staleness: int, max_staleness: int) -> bool:
    """The one staleness rule (docs/off-policy-rollouts.md): tokens sampled `staleness` policy updates ago may
    train while that is at most `max_staleness`; older ones are dropped (their correction would be too far off).
    The buffer's groups (RolloutBuffer.take) and the server's batches asked ahead (ServerGeneration) both apply it."""
    return staleness <= max_staleness


@dataclass
class RolloutGroup:
    """The G completions of one prompt; `prompt_ids` and `inputs` (the dataset row the rewards read) as given."""

    group_id: int
    prompt_ids: list[int]
    rollouts: list[Rollout]
    inputs: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.rollouts)

    @property
    def oldest_version(self) -> int | None:
        versions = [r.oldest_version for r in self.rollouts if r.versions]
        return min(versions) if versions else None

    def staleness(self, version: int) -> int:
        """Policy updates between the oldest token's sampling and `version` (0: every token from this policy)."""
        oldest = self.oldest_version
        return 0 if oldest is None else version - oldest

    def host_bytes(self) -> int:
        """What the record holds in host memory (`record_bytes`): tests/test_rollouts.py checks it against
        tracemalloc."""
        routing = sum(r.routed_experts.nbytes for r in self.rollouts if r.routed_experts is not None)
        return record_bytes(len(self.prompt_ids), sum(len(r.completion_ids) for r in self.rollouts)) + routing


class RolloutBuffer:
    """Groups waiting to train: complete ones go out oldest first, within the staleness bound; the rest wait."""

    def __init__(self, num_generations: int, max_staleness: int = 1):
        if max_staleness < 0:
            raise ValueError(f"max_staleness {max_staleness} must be >= 0 (0: on-policy only)")
        self.num_generations, self.max_staleness = num_generations, max_staleness
        self.groups: list[RolloutGroup] = []
        self.stats = {"taken_groups": 0, "dropped_groups": 0, "dropped_completion_tokens": 0,
                      "taken_completion_tokens": 0}

    def add(self, group: RolloutGroup) -> None:
        if len(group.rollouts) != self.num_generations:
            raise ValueError(f"group {group.group_id} has {len(group.rollouts)} completions, not "
                             f"num_generations={self.num_generations}")
        self.groups.append(group)

    def take(self, n_groups: int, version: int) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
        """(ready, dropped): up to n_groups complete groups within the bound, oldest first, and the complete or
        partial groups past the bound (removed: their oldest tokens can no longer be corrected for)."""
        keep = [g for g in self.groups if within_staleness(g.staleness(version), self.max_staleness)]
        kept = {id(g) for g in keep}
        dropped = [g for g in self.groups if id(g) not in kept]
        ready = sorted((g for g in keep if g.complete), key=lambda g: (g.oldest_version, g.group_id))[:n_groups]
        taken = {id(g) for g in ready}
        self.groups = [g for g in keep if id(g) not in taken]
        self.stats["taken_groups"] += len(ready)
        self.stats["dropped_groups"] += len(dropped)
        self.stats["taken_completion_tokens"] += sum(len(r.completion_ids) for g in ready for r in g.rollouts)
        self.stats["dropped_completion_tokens"] += sum(len(r.completion_ids) for g in dropped for r in g.rollouts)
        return ready, dropped

    @property
    def partial(self) -> list[RolloutGroup]:
        """Groups some of whose completions are still running: what a step carries into the next."""
        return [g for g in self.groups if not g.complete]

    def host_bytes(self) -> int:
        return sum(g.host_bytes() for g in self.groups)

    def state_dict(self) -> dict:
        """Plain Python (JSON-able): a checkpoint holds the carried rollouts, so a resume continues them."""
        groups = [dataclasses.asdict(g) for g in self.groups]
        for g in groups:
            for r in g["rollouts"]:
                r["routed_experts"] = None if r["routed_experts"] is None else r["routed_experts"].tolist()
        return {"num_generations": self.num_generations, "max_staleness": self.max_staleness,
                "stats": dict(self.stats), "groups": groups}

    @classmethod
    def from_state_dict(cls, state: dict) -> RolloutBuffer:
        buffer = cls(state["num_generations"], state["max_staleness"])
        buffer.stats.update(state["stats"])
        for g in state["groups"]:
            rollouts = [Rollout(**{**r, "routed_experts": None if r.get("routed_experts") is None else
                                   torch.tensor(r["routed_experts"], dtype=torch.int16)}) for r in g["rollouts"]]
            buffer.groups.append(RolloutGroup(g["group_id"], list(g["prompt_ids"]), rollouts, dict(g["inputs"])))
        return buffer


__all__ = ["Rollout", "RolloutBuffer", "RolloutGroup", "merge_routing", "within_staleness"]
