"""GRPOAccelTrainer: TRL's GRPOTrainer with grpo_accel's memory savers plugged into its hooks.

Overrides as little as possible; the loss math stays TRL's (`_compute_loss`), so our numbers are
TRL's numbers. What it adds:
- reward functions are wrapped so a failing one is named in a clear error, never a silent 0.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from .config import GRPOAccelConfig
from .rewards import guarded


class GRPOAccelTrainer(GRPOTrainer):
    def __init__(self, model, reward_funcs, args: GRPOAccelConfig | None = None, **kwargs):
        if not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        # Reward models (nn.Module) and hub ids (str) are TRL's business; plain functions get the guard.
        reward_funcs = [f if isinstance(f, (str, torch.nn.Module)) else guarded(f) for f in reward_funcs]
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
