"""Truncated sampling, one distribution (issue 65 item 3; docs/off-policy-rollouts.md "Truncated sampling").

With top_k / top_p / min_p on, every route that records a behaviour log-prob records the truncated, renormalised
distribution's (vLLM's `processed_logprobs`, colocated or served; transformers' continuous batching under
`--rollout_budget`), while TRL scores the full tempered distribution: its ratio exp(old - behaviour) sits at the kept
mass Z, not 1, on-policy. We keep TRL's loss and gradient (the policy and old log-probs stay the full distribution's)
and put the behaviour log-prob on the full distribution: behaviour + log Z, Z the mass the old policy's tempered
distribution puts on the support the sampler's own rule keeps (ops/truncation.py), from the logits the old pass
computes anyway. On-policy the ratio is then pi / (q_truncated * Z) = 1.

How it sits in TRL 1.16's `_generate_and_score_completions`: its first call of the log-prob hook there is the old
pass (taken whenever its correction is on: tests/test_rollouts.py pins the gates), and the ratio is computed right
after it from `old - sampling`. So `KeptMassCorrection.score` marks the method's run; the hook's next call returns
`old - log Z` (the ratio and its metrics, in TRL's own code and clipping, are then those of the full behaviour
log-prob); when the method returns, its output gets the old log-probs back as computed and `sampling_per_token_logps`
+ log Z (what TRL's off-policy mask reads). Without truncation nothing of this is installed.
"""

from __future__ import annotations

from grpo_accel.core.console import log
from grpo_accel.generation.vllm_generation import sampling_settings
from grpo_accel.ops.truncation import Truncation
from grpo_accel.trainer.carried_rollouts import BudgetMode


def sampler_truncation(trainer) -> Truncation | None:
    """The truncation of the sampler whose log-probs TRL's ratio reads, in that sampler's order, read where the
    sampler reads it; None where nothing is truncated or no ratio is computed (TRL's generate(), continuous batching
    without a budget: no behaviour log-probs)."""
    args = trainer.args
    if not (trainer.use_vllm and args.vllm_importance_sampling_correction):
        return None
    mode = trainer.generation_mode
    if isinstance(mode, BudgetMode) and not mode.engine_rounds:  # a budget over transformers' continuous batching
        g = trainer.generation_config
        if not g.do_sample:
            return None
        t = Truncation(top_k=int(g.top_k or 0), top_p=1.0 if g.top_p is None else float(g.top_p),
                       min_p=float(g.min_p or 0.0), min_p_first=False)
    else:  # vLLM, colocated or served: the SamplingParams TRL's and our routes send (generation_kwargs included)
        s = sampling_settings(args)
        t = Truncation(top_k=max(int(s["top_k"] or 0), 0), top_p=float(s["top_p"]), min_p=float(s["min_p"] or 0.0))
    return t if t.on else None


class KeptMassCorrection:
    """The correction for one run's sampler truncation (module docstring): `score` wraps TRL's method, `old_pass`
    answers the hook's first call inside it."""

    def __init__(self, truncation: Truncation):
        self.truncation = truncation
        self.pending = False  # inside TRL's method, before its old pass
        self.found = None  # (old log-probs as computed, log Z) of this run of the method
        self.uncorrected_said = False

    def score(self, score, inputs):
        self.pending, self.found = True, None
        try:
            output = score(inputs)
        finally:
            self.pending = False
        found, self.found = self.found, None
        if found is not None:
            old, log_z = found
            output["old_per_token_logps"] = old  # the loss's old policy: the full distribution, bit for bit
            if "sampling_per_token_logps" in output:
                output["sampling_per_token_logps"] = output["sampling_per_token_logps"] + log_z
        return output

    def old_pass(self, passes):
        """`passes(truncation)`: the log-prob passes' (logps, entropies, aux, log Z or None). Returns the hook's
        triple with `old - log Z` as its log-probs."""
        self.pending = False
        logps, entropies, aux, log_z = passes(self.truncation)
        if log_z is None:
            if not self.uncorrected_said:
                self.uncorrected_said = True
                log("truncated sampling: this old-policy pass is not our head's (TRL's head, multimodal inputs or "
                    "SP), so TRL's importance ratio keeps the kept mass (TRL 1.16's bias)")
            return logps, entropies, aux
        self.found = (logps, log_z)
        return logps - log_z, entropies, aux


def kept_mass_correction(trainer) -> KeptMassCorrection | None:
    """The run's correction, or None (no truncation, no ratio); one line saying which rule and why."""
    truncation = sampler_truncation(trainer)
    if truncation is None:
        return None
    log(f"truncated sampling (top_k {truncation.top_k}, top_p {truncation.top_p}, min_p {truncation.min_p}): "
        "behaviour log-probs put on the trainer's full distribution (+ log of the mass its old policy puts on the "
        f"sampler's support, {'vLLM' if truncation.min_p_first else 'transformers'}' rule), so the importance ratio "
        "is 1 on-policy")
    return KeptMassCorrection(truncation)


__all__ = ["KeptMassCorrection", "kept_mass_correction", "sampler_truncation"]
