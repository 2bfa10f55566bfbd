"""GRPOAccelTrainer (trainer.py) wires the savers into TRL's GRPOTrainer hooks; GRPOAccelConfig (config.py);
resumable checkpoints (checkpoints.py); callbacks/ (guards, preemption, telemetry, learning signal)."""
