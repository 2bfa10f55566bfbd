"""grpo_accel: memory savers for long-completion GRPO training on TRL's GRPOTrainer.

The public API, the one import path for scripts, examples and docs:

    from grpo_accel import GRPOAccelConfig, GRPOAccelTrainer   # in place of trl's GRPOConfig, GRPOTrainer

    GRPOAccelTrainer, GRPOAccelConfig   the trainer and its config (TRL's, plus the savers' options)
    Preset, get_preset, list_presets    the per-GPU presets (accelerate_configs/<name>.yaml + training flags)
    plan_memory, model_shape, MemoryPlan, find_max_completion_length
                                        the memory planner: a step's per-device bytes, before any download

Everything else (grpo_accel.<layer>.<module>) is internal: docs/architecture.md says what lives where. Names load on
first use, so `import grpo_accel` stays cheap for a process that only plans or reads a preset.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOAccelTrainer": "grpo_accel.trainer.trainer",
    "GRPOAccelConfig": "grpo_accel.trainer.config",
    "Preset": "grpo_accel.app.presets",
    "get_preset": "grpo_accel.app.presets",
    "list_presets": "grpo_accel.app.presets",
    "plan_memory": "grpo_accel.planning.memory",
    "MemoryPlan": "grpo_accel.planning.memory",
    "find_max_completion_length": "grpo_accel.planning.fitting",
    "model_shape": "grpo_accel.planning.architectures",
}
__all__ = ["GRPOAccelConfig", "GRPOAccelTrainer", "MemoryPlan", "Preset", "find_max_completion_length", "get_preset",
           "list_presets", "model_shape", "plan_memory"]
assert sorted(_EXPORTS) == __all__

if TYPE_CHECKING:
    from grpo_accel.app.presets import Preset, get_preset, list_presets
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.fitting import find_max_completion_length
    from grpo_accel.planning.memory import MemoryPlan, plan_memory
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grpo_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
