"""grpo_accel: memory savers for long-completion GRPO training on TRL's GRPOTrainer."""

__version__ = "0.1.0"
