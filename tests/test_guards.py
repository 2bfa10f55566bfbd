"""Non-finite steps are skipped, never applied; N in a row stop training without saving the bad state."""

import ast
import math
import os

import pytest
import torch
from peft import LoraConfig
from support.launch import ROOT, run_train
from support.rewards import length_reward

from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.trainer import GRPOAccelTrainer

ACCELERATE = os.path.join(os.path.dirname(os.sys.executable), "accelerate")


def test_nan_steps_are_skipped_then_stop(tmp_path):
    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=6, report_to="none", max_steps=6, save_steps=1, logging_steps=1,
                           max_nonfinite_steps=2, seed=0)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 24), peft_config=LoraConfig(r=4))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    norm = trainer.model.get_base_model().model.norm
    # Poison only training forwards (grad enabled): generation stays finite, every loss becomes NaN.
    norm.register_forward_hook(lambda m, i, out: out * float("nan") if torch.is_grad_enabled() else out)
    trainer.train()
    guard = trainer.nonfinite_guard
    assert guard.stopped_at == 2 and guard.skipped == 2
    assert trainer.state.global_step == 2
    for name, p in trainer.model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), f"{name} changed by a non-finite step"
            assert p.isfinite().all()
    logged = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["nonfinite/skipped_steps"] for h in logged] == [1.0, 2.0]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert f"last good checkpoint is {tmp_path / 'checkpoint-1'}" in str(guard.error(str(tmp_path)))


def test_deepspeed_guard_counts_skips_and_waits_out_fp16_calibration():
    """fp16's dynamic loss scaler overflows on purpose while it halves 2^16 down: those skips are counted but do
    not stop the run; once the scale is 1 (or without fp16) N skips in a row do."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from grpo_accel.trainer.callbacks.guards import DeepSpeedSkipGuard

    ds_optimizer = SimpleNamespace(loss_scale=2.0**16)
    accelerator = SimpleNamespace(optimizer_step_was_skipped=True,
                                  _optimizers=[SimpleNamespace(optimizer=ds_optimizer)])
    guard, state, control = DeepSpeedSkipGuard(2, accelerator), TrainerState(), TrainerControl()
    fp16 = SimpleNamespace(fp16=True)
    for _ in range(5):  # calibrating: 2^16 .. 2^12
        guard.on_optimizer_step(fp16, state, control)
        ds_optimizer.loss_scale /= 2
        state.global_step += 1
    assert guard.skipped == 5 and guard.stopped_at is None and not control.should_training_stop
    ds_optimizer.loss_scale = 1.0
    guard.on_optimizer_step(fp16, state, control)
    state.global_step += 1
    accelerator.optimizer_step_was_skipped = False  # a good step resets the run of skips
    guard.on_optimizer_step(fp16, state, control)
    state.global_step += 1
    accelerator.optimizer_step_was_skipped = True
    for _ in range(2):
        guard.on_optimizer_step(SimpleNamespace(fp16=False), state, control)
        state.global_step += 1
    assert guard.stopped_at == 9 and control.should_training_stop and not control.should_save
    assert guard.metrics() == {"nonfinite/skipped_steps": 8.0}

    # A step DeepSpeed applied although its gradient norm was not finite (bf16 without check_grad_overflow):
    # the weights are poisoned, the run stops at once, and the error says so.
    engine = SimpleNamespace(get_global_grad_norm=lambda: float("nan"))
    accelerator.optimizer_step_was_skipped = False
    accelerator.deepspeed_engine_wrapped = SimpleNamespace(engine=engine)
    guard, control = DeepSpeedSkipGuard(3, accelerator), TrainerControl()
    guard.on_optimizer_step(SimpleNamespace(fp16=False), state, control)
    assert guard.stopped_at == state.global_step + 1 and control.should_training_stop and not control.should_save
    assert "applied non-finite gradients" in str(guard.error("/nonexistent"))


@pytest.mark.distributed
def test_deepspeed_skips_count_and_stop_naming_last_good_checkpoint(tmp_path):
    """2-process ZeRO-2 over gloo: steps 3 and 4 are NaN. DeepSpeed's optimizer skips them itself; the skips show in
    the logged metrics and 2 in a row stop the run with NonFiniteStepsError naming checkpoint-2 (never a later one)."""
    out = tmp_path / "zero2-nan"
    config = os.path.join(ROOT, "accelerate_configs", "cpu_zero2.yaml")
    result = run_train(["--eval_size", "0", "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1",
                        "--max_nonfinite_steps", "2", "--rewards", "support.nonfinite:length_then_nan",
                        "--output_dir", str(out)],
                       launcher=[ACCELERATE, "launch", "--config_file", config], timeout=400, NAN_FROM_STEP="3")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]  # rank 0 says it once per launch
    assert "exitcode  : 2" in result.stderr  # the user-error code (torch's agent may stop the other rank first)
    for line in lines:
        assert "stopped at step 4" in line and f"last good checkpoint is {out / 'checkpoint-2'}" in line, line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    logged = [ast.literal_eval(s) for s in result.stdout.splitlines() if s.startswith("{'loss'")]
    assert [float(h["nonfinite/skipped_steps"]) for h in logged] == [0.0, 0.0, 1.0, 2.0], result.stdout[-3000:]
    assert "DeepSpeed skipped the step" in result.stdout


def fp16_trainer(tmp_path, init_scale, max_nonfinite_steps=3, poison=False):
    """A GRPO trainer whose steps run under real fp16 autocast with torch's dynamic GradScaler, as accelerate sets up
    for fp16 on a GPU (accelerate refuses fp16 on a CPU device, so the scaler is put in by hand here). fp16 holds
    values up to 65504: the scaled backward of this tiny model overflows while the scale is above 2^18."""
    model, tokenizer = load_model("tiny-llama")
    if poison:  # every forward with grad returns NaN: non-finite whatever the scale
        nan = lambda m, a, out: out * float("nan") if torch.is_grad_enabled() else None
        model.model.norm.register_forward_hook(nan)
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=8, report_to="none", max_steps=8, save_steps=100, logging_steps=1,
                           seed=0, disable_tqdm=True, max_nonfinite_steps=max_nonfinite_steps, learning_rate=1e-3)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 64), peft_config=LoraConfig(r=4))
    acc = trainer.accelerator
    acc.state._mixed_precision, acc.native_amp = "fp16", True
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return trainer


def test_fp16_loss_scale_warmup_trains_to_the_end(tmp_path):
    """Scale 2^23: the scaler skips steps 1-5 while it halves to 2^18 (by design), then every step is finite. The
    guard counts those skips but they are the scaler calibrating, not a broken run: all 8 steps run. Before the
    fix the guard stopped this run at step 3 (it cleared the gradients of the overflowing steps, so the scaler saw
    nothing to back off from, and counted each one towards its stop)."""
    trainer = fp16_trainer(tmp_path, init_scale=2.0**23)
    trainer.train()
    guard = trainer.nonfinite_guard
    assert guard.stopped_at is None and trainer.state.global_step == 8
    norms = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(n) for n in norms[5:]), norms  # past the warm-up: applied, finite steps
    assert guard.skipped == 5
    assert trainer.accelerator.scaler.get_scale() == 2.0**18


def test_fp16_nonfinite_at_the_scale_floor_still_stops(tmp_path):
    """NaN in every forward: the scaler halves 4 -> 2 -> 1 (calibrating), then 3 more skips in a row at scale 1
    stop the run with its error naming the fix."""
    trainer = fp16_trainer(tmp_path, init_scale=4.0, poison=True)
    trainer.train()
    guard = trainer.nonfinite_guard
    assert guard.stopped_at is not None and guard.stopped_at < 8, guard.stopped_at
    message = str(guard.error(str(tmp_path)))
    assert message.startswith(f"stopped at step {guard.stopped_at}: 3 steps in a row had non-finite gradients")
    assert "Fix: lower --learning_rate" in message
