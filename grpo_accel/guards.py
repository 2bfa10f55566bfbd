"""Non-finite guard: a step whose gradients are NaN/inf is skipped, not applied; N in a row stop the run.

One bad batch (an overflow, a degenerate group) should cost one step, not the run: the optimizer
would otherwise write NaN into every weight it touches, and every later checkpoint would be poison.
Cost: one norm per gradient tensor per optimizer step (an [n_params] reduction, negligible).
Not active under DeepSpeed, whose engine owns the step (its fp16 loss scaler skips overflow steps itself).
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback


class NonFiniteStepsError(RuntimeError):
    pass


def grads_finite(params) -> bool:
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return not norms or bool(torch.stack(norms).isfinite().all())


class NonFiniteGuard(TrainerCallback):
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0
        self.stopped_at: int | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = [p for p in model.parameters() if p.requires_grad]
        if grads_finite(params):
            self.in_a_row = 0
            return
        for p in params:  # AdamW skips parameters without a gradient: the step becomes a no-op
            p.grad = None
        self.in_a_row += 1
        self.skipped += 1
        print(f"[grpo_accel] step {state.global_step + 1}: non-finite gradients, update skipped "
              f"({self.in_a_row} in a row, stop at {self.max_in_a_row})", flush=True)
        if self.in_a_row >= self.max_in_a_row:
            self.stopped_at = state.global_step + 1
            control.should_training_stop = True
            control.should_save = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is not None:
            control.should_save = False  # keep the last good checkpoint as the newest one

    def metrics(self) -> dict[str, float]:
        return {"nonfinite/skipped_steps": float(self.skipped)}
