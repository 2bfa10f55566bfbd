"""The sampler/trainer mismatch, measured every step (docs/off-policy-rollouts.md, "The mismatch, every step").

- `sampling/logp_gap_mean`: mean over completion tokens of d = logp_train - logp_behaviour (the trainer's old-policy
  log-prob of the sampled token minus the sampler's), signed; TRL's `sampling/sampling_logp_difference/{mean,max}`
  is |d|'s mean and max.
- `sampling/k3_kl`: the k3 estimate of KL(behaviour || trainer), mean of exp(d) - 1 - d over the same tokens
  (unbiased, never negative per token, as in Schulman's "Approximating KL divergence"; k1 = -d's mean can go negative).
- `routing/flip_frac` (MoE): of the (token, layer) routings with a record, the share the trainer's own top-k puts on
  other experts than the sampler did; `routing/applied_flip_frac`: the share that ran on other experts (0 with
  routing replay, = flip_frac without); `routing/recorded_rows`: the share of the passes' rows that had a record.

Tokens whose behaviour log-prob is NaN (sampled by the trained policy itself on the budget's route) are left out, as
TRL leaves them out of its figure. Figures are this rank's tokens since the last log line.
"""

from __future__ import annotations

import torch


class MismatchMeter:
    """Sums of the figures above since the last `pop_metrics`, owned by the trainer (`mismatch`)."""

    def __init__(self, routing_replay=None, routing_records=None):
        self.routing_replay, self.routing_records = routing_replay, routing_records
        self.tokens, self.gap_sum, self.k3_sum = 0, 0.0, 0.0

    def observe(self, output: dict) -> None:
        """One generation batch's TRL output dict: old-policy and behaviour log-probs where TRL computed both."""
        old, behaviour = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or behaviour is None:
            return
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask &= output["tool_mask"].bool()
        d = (old - behaviour).double()[mask]
        d = d[torch.isfinite(d)]
        self.tokens += d.numel()
        self.gap_sum += float(d.sum())
        self.k3_sum += float((torch.expm1(d) - d).sum())  # exp(d) - 1 - d, expm1 keeps small d exact

    def pop_metrics(self) -> dict[str, float]:
        out = {}
        if self.tokens:
            out = {"sampling/logp_gap_mean": self.gap_sum / self.tokens, "sampling/k3_kl": self.k3_sum / self.tokens}
        self.tokens, self.gap_sum, self.k3_sum = 0, 0.0, 0.0
        if self.routing_replay is not None:
            compared, flipped, applied = self.routing_replay.pop_counts()
            found, missing = self.routing_records.pop_rows()
            if compared:
                out.update({"routing/flip_frac": flipped / compared, "routing/applied_flip_frac": applied / compared})
            if found + missing:
                out["routing/recorded_rows"] = found / (found + missing)
        return out
