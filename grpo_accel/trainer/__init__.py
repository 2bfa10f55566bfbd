"""GRPOAccelTrainer (trainer.py) wires the savers into TRL's GRPOTrainer hooks, its log-prob passes in
logprob_passes.py and its reward guard in reward_guard.py; GRPOAccelConfig (config.py); resumable checkpoints
(checkpoints.py); callbacks/ (guards, preemption, telemetry, learning signal)."""
