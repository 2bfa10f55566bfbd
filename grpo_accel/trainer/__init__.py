"""GRPOAccelTrainer (trainer.py) wires the savers (savers.py) into TRL's GRPOTrainer hooks, its log-prob passes in
logprob_passes.py and its reward guard in reward_guard.py, and forwards generation to one mode object
(generation_modes.py: TRL's generate() and colocated vLLM; paged_generation.py: continuous batching; server_mode.py:
a vLLM server; carried_rollouts.py: --rollout_budget); DAPO's dynamic sampling (dynamic_sampling.py), truncated
sampling's behaviour log-probs on the trainer's distribution (truncated_sampling.py), the sampler/trainer mismatch
per step (mismatch.py); GRPOAccelConfig (config.py); resumable checkpoints
(checkpoints.py); callbacks/ (guards, preemption, telemetry, learning signal)."""
