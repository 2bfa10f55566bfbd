"""Warn when a GRPO step has no learning signal: a run that trains on nothing should say so, not pass silently.

Two ways a GRPO step computes an all-zero advantage (loss and gradient ~0, the run goes nowhere):
- every completion hit max_completion_length (`completions/clipped_ratio` = 1): none ends, rewards rarely differ;
- every group of completions got equal rewards (`frac_reward_zero_std` = 1): the reward or the task gives the
  group nothing to compare.
One line when it starts, then one every `every_steps` steps while it lasts, naming the likely cause and the fix.
Costs nothing: it reads the metrics TRL already logs.
"""

from __future__ import annotations

from transformers import TrainerCallback

from grpo_accel.core.console import log

FULL = 0.999  # a fraction this close to 1 is "every"


class LearningSignalWatch(TrainerCallback):
    def __init__(self, max_completion_length: int, every_steps: int = 10):
        self.max_completion_length = max_completion_length
        self.every_steps = every_steps
        self.streaks = {"clipped": 0, "equal_rewards": 0}
        self.warnings: list[str] = []  # every line printed (tests read it)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs and "reward" not in logs:
            return
        step = state.global_step
        self._watch("clipped", logs.get("completions/clipped_ratio"), step,
                    f"every completion hit --max_completion_length {self.max_completion_length} (clipped_ratio 1.0): "
                    f"none ends, so there is nothing to reward. Fix: raise --max_completion_length, or ask for "
                    f"shorter answers in the prompt.")
        self._watch("equal_rewards", logs.get("frac_reward_zero_std"), step,
                    "every group's completions got equal rewards (frac_reward_zero_std 1.0): all advantages are 0 "
                    "and the step learns nothing. Likely cause: the reward function (constant, or never matching "
                    "the model's answer format) or a task too hard or too easy for the model.")

    def _watch(self, key: str, value, step: int, message: str) -> None:
        if value is None or value < FULL:
            self.streaks[key] = 0
            return
        self.streaks[key] += 1
        streak = self.streaks[key]
        if streak == 1 or streak % self.every_steps == 0:
            line = f"no learning signal at step {step}" + (f" ({streak} steps in a row)" if streak > 1 else "") + \
                f": {message}"
            self.warnings.append(line)
            log(line)
