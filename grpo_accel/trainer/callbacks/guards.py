"""Non-finite guard: a step whose gradients are NaN/inf is skipped, not applied; N in a row stop the run.

One bad batch (an overflow, a degenerate group) should cost one step, not the run: the optimizer
would otherwise write NaN into every weight it touches, and every later checkpoint would be poison.
Cost: one norm per gradient tensor per optimizer step (an [n_params] reduction, negligible).
Under DeepSpeed the engine owns the step and skips it itself (ZeRO's optimizer finds a non-finite gradient norm:
fp16 loss-scale overflow, NaN/inf in fp32, bf16 with `check_grad_overflow`); `DeepSpeedSkipGuard` counts those
skips into the same metric and stops the run the same way. Cost there: none (reads a flag DeepSpeed sets).
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from grpo_accel.core.console import log
from grpo_accel.core.errors import UserError
from grpo_accel.data.rewards import RELAX_FLAG, RewardFunctionError
from grpo_accel.trainer.checkpoints import latest_complete_checkpoint


class NonFiniteStepsError(UserError, RuntimeError):
    pass


def grads_finite(params) -> bool:
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return not norms or bool(torch.stack(norms).isfinite().all())


class _SkipCounter(TrainerCallback):
    """Counts skipped steps, stops after `max_in_a_row` in a row without saving, builds the error."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0
        self.stopped_at: int | None = None
        self.applied_nonfinite = False  # DeepSpeed only: a non-finite step it applied instead of skipping

    def _count(self, skipped: bool, state, control, why: str, towards_stop: bool = True) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += int(towards_stop)
        log(f"step {state.global_step + 1}: {why}, update skipped ({self.in_a_row} in a row, "
            f"stop at {self.max_in_a_row})")
        if self.in_a_row >= self.max_in_a_row:
            self.stopped_at = state.global_step + 1
            control.should_training_stop = True
            control.should_save = False

    def _count_loss_scaled(self, skipped: bool, scale: float | None, state, control, why: str) -> None:
        """A step a dynamic loss scaler skipped. Overflowing is how the scaler finds its scale (it halves from 2^16
        and skips, at the start and whenever gradients grow): those skips count in the metric, and towards the stop
        only once the scale is at its floor, 1 (DeepSpeed's min_loss_scale), where halving no longer helps."""
        calibrating = scale is not None and scale > 1
        why = f"{why}{f', loss scale {scale:g}' if scale else ''})"  # `why` opens the parenthesis
        self._count(skipped, state, control, why, towards_stop=not calibrating)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is not None:
            control.should_save = False  # keep the last good checkpoint as the newest one

    def metrics(self) -> dict[str, float]:
        return {"nonfinite/skipped_steps": float(self.skipped)}

    def error(self, output_dir: str) -> NonFiniteStepsError:
        good = latest_complete_checkpoint(output_dir)
        where = (f"The last good checkpoint is {good}" if good else
                 f"No checkpoint was saved before it (none in {output_dir})")
        then = "--resume_from_checkpoint latest" if good else "start again"
        what = (f"step {self.stopped_at} applied non-finite gradients (DeepSpeed did not skip it: set "
                f"bf16.check_grad_overflow true in its config)" if self.applied_nonfinite else
                f"{self.max_in_a_row} steps in a row had non-finite gradients (skipped, never applied)")
        return NonFiniteStepsError(
            f"stopped at step {self.stopped_at}: {what}. {where}. Fix: lower --learning_rate, check the reward "
            f"functions and data, then {then}.")


class NonFiniteGuard(_SkipCounter):
    """Without DeepSpeed. With fp16's dynamic loss scaler (accelerate's GradScaler) the scaler itself skips a
    non-finite step and halves its scale; the guard then only counts (gradients untouched: cleared gradients would
    hide the overflow from the scaler, which would never back off). Else it clears them, making the step a no-op."""

    def __init__(self, max_in_a_row: int, accelerator=None):
        super().__init__(max_in_a_row)
        self.accelerator = accelerator

    def _scaler(self):
        return getattr(self.accelerator, "scaler", None)

    def on_optimizer_step(self, args, state, control, **kwargs):
        scaler = self._scaler()
        if scaler is not None:
            # The scaler backs off exactly when it found a non-finite gradient and skipped the step. Not accelerate's
            # optimizer_step_was_skipped: it reads False whenever the optimizer takes the scaler's found_inf itself
            # (torch's AdamW does: `_step_supports_amp_scaling`), skipped or not.
            scale = scaler.get_scale()
            self._count_loss_scaled(scale < self._scale_before, scale, state, control,
                                    "the loss scaler skipped the step (non-finite gradients")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._scaler() is not None:
            self._scale_before = self._scaler().get_scale()
            return
        params = [p for p in model.parameters() if p.requires_grad]
        finite = grads_finite(params)
        if not finite:
            for p in params:  # AdamW skips parameters without a gradient: the step becomes a no-op
                p.grad = None
        self._count(not finite, state, control, "non-finite gradients")


class DeepSpeedSkipGuard(_SkipCounter):
    """The DeepSpeed engine has already stepped (inside accelerator.backward) when the Trainer's optimizer step
    runs; accelerate exposes whether it skipped. fp16's dynamic loss scaler skips its first steps while it halves
    the scale down from 2^16: those count in the metric but not towards the stop until the scale reaches 1."""

    def __init__(self, max_in_a_row: int, accelerator):
        super().__init__(max_in_a_row)
        self.accelerator = accelerator

    def on_optimizer_step(self, args, state, control, **kwargs):
        skipped = bool(self.accelerator.optimizer_step_was_skipped)
        if not skipped and not math.isfinite(self._grad_norm()):
            # Applied anyway (bf16 ZeRO-1/2 with DeepSpeed's `check_grad_overflow` off, or a DeepSpeed without it):
            # the weights are no longer finite, so no later checkpoint may be written. Stop now.
            self.applied_nonfinite = True
            self.skipped += 1
            self.stopped_at = state.global_step + 1
            control.should_training_stop, control.should_save = True, False
            log(f"step {self.stopped_at}: DeepSpeed applied a step with a non-finite gradient norm; stopping "
                f"without saving")
            return
        scale = None
        if skipped:
            ds_optimizer = getattr(self.accelerator._optimizers[0], "optimizer", None) if \
                self.accelerator._optimizers else None
            scale = getattr(ds_optimizer, "loss_scale", None)
        self._count_loss_scaled(skipped, scale if args.fp16 else None, state, control,
                                "DeepSpeed skipped the step (non-finite gradients")

    def _grad_norm(self) -> float:
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        norm = wrapped.engine.get_global_grad_norm() if wrapped is not None else None
        return 0.0 if norm is None else float(norm)


def check_reward_rows(rewards_per_func: torch.Tensor, names: list[str], model_columns: list[int]) -> None:
    """reward_checks="strict" on one generation batch's rewards ([rows, functions], None already NaN, as TRL
    gathers them): stop on a row that no reward scored (TRL warns and trains on, with advantage 0) and on a reward
    model's NaN / inf (a function's are caught by its guard, trainer/reward_guard.py). A reward that is None for
    some rows, or a whole batch, beside one that scores them is TRL's documented multi-task case and passes.
    Cost: two [rows, functions] reductions per generation batch."""
    for i in model_columns:
        column = rewards_per_func[:, i]
        if not column.isfinite().all():
            raise RewardFunctionError(
                f"reward model {names[i]!r} gave non-finite scores ({int((~column.isfinite()).sum())} of "
                f"{len(column)} rows). Fix: check the model's weights and dtype (fp16 overflows), or pass "
                f"{RELAX_FLAG} to train on with NaN as 'no reward'.")
    blank = rewards_per_func.isnan().all(dim=1).nonzero(as_tuple=True)[0].tolist()
    if blank:
        raise RewardFunctionError(
            f"{len(blank)} of {len(rewards_per_func)} completions got no reward from any of {names} (each returned "
            f"None or NaN; first: row {blank[0]}): the run would train on a blank reward. Fix: make at least one "
            f"reward score every row (None is for rows a reward does not apply to, beside another that scores "
            f"them), or pass {RELAX_FLAG} to train on with TRL's warning.")
