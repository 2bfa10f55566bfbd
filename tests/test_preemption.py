"""SIGTERM (what clouds and schedulers send before SIGKILL): the step in flight finishes, a checkpoint is saved,
one line says how to resume, exit 0; `--resume_from_checkpoint latest` then logs what an uninterrupted run logs.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_preemption.py
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from peft import LoraConfig
from support.launch import ROOT, TINY_ARGS, child_env, run_train
from transformers import TrainerCallback

ARGS = [*TINY_ARGS, "--max_steps", "6", "--save_steps", "2", "--eval_size", "0", "--save_total_limit", "3",
        "--rewards", "support.rewards:length_reward"]
KEYS = ("loss", "reward", "grad_norm", "completions/mean_length")


def rows(out):
    return {int(float(r["step"])): r for r in csv.DictReader(open(out / "metrics.csv"))}


def test_sigterm_mid_step_finishes_it_saves_and_stops(tmp_path):
    """In-process: a SIGTERM during step 2's generation; step 2 completes, checkpoint-2 is complete, training stops,
    and the process's own SIGTERM handler is back once train() returns."""
    from support.rewards import length_reward

    from grpo_accel.data.datasets import arithmetic_dataset
    from grpo_accel.data.models import load_model
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    class SigtermInStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered before the step's first bytecodes run

    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=6, report_to="none", max_steps=6, save_steps=100, logging_steps=5,
                           seed=0, disable_tqdm=True)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 24), peft_config=LoraConfig(r=4),
                               callbacks=[SigtermInStep2()])
    before = signal.getsignal(signal.SIGTERM)
    trainer.train()
    assert signal.getsignal(signal.SIGTERM) is before
    assert trainer.preemption.preempted and trainer.preemption.stopped_at == 2
    assert trainer.state.global_step == 2
    # logging_steps 5: steps 1-2 were not due for a log, the stop logs them before the save.
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [2]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert [h["step"] for h in saved["log_history"] if "loss" in h] == [2]
    assert "--resume_from_checkpoint latest" in trainer.preemption.resume_line(str(tmp_path))


def test_handlers_are_restored_when_train_raises(tmp_path):
    """A reward that raises stops train() with RewardFunctionError; every signal handler is then what it was before
    train() (the handler went in at on_train_begin, and on_train_end never runs when train() raises)."""
    from grpo_accel.data.datasets import arithmetic_dataset
    from grpo_accel.data.models import load_model
    from grpo_accel.data.rewards import RewardFunctionError
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    def broken_reward(prompts, completions, **kwargs):
        raise ValueError("reward server down")

    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=4, report_to="none", max_steps=2, save_steps=100, seed=0,
                           disable_tqdm=True)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[broken_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 8), peft_config=LoraConfig(r=4))
    before = {s: signal.getsignal(s) for s in signal.valid_signals() if signal.getsignal(s) is not None}
    with pytest.raises(RewardFunctionError):
        trainer.train()
    after = {s: signal.getsignal(s) for s in before}
    assert after == before, {signal.Signals(s).name: h for s, h in after.items() if h != before[s]}


def sigterm_after(cmd, checkpoint_state, env, timeout=300):
    """Start `cmd`, SIGTERM its first process once `checkpoint_state` exists; (returncode, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + timeout
    try:
        while not checkpoint_state.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert checkpoint_state.exists(), "the run ended before its first checkpoint"
        proc.send_signal(signal.SIGTERM)  # the launcher only, as a scheduler signals a job's first process
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def test_sigterm_then_resume_matches_uninterrupted(tmp_path):
    full = tmp_path / "full"
    done = run_train([*ARGS, "--output_dir", str(full)])
    assert done.returncode == 0, done.stderr[-3000:]

    cut = tmp_path / "cut"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *ARGS, "--output_dir", str(cut)]
    rc, stdout, stderr = sigterm_after(cmd, cut / "checkpoint-2" / "trainer_state.json", child_env())
    assert rc == 0, stderr[-3000:]
    assert "SIGTERM received" in stderr
    resume_lines = [line for line in stdout.splitlines() if "--resume_from_checkpoint latest" in line]
    assert len(resume_lines) == 1, stdout[-3000:]
    stopped = max(int(p.name.split("-")[1]) for p in cut.glob("checkpoint-*"))
    assert 2 < stopped < 6, "SIGTERM should land in step 3 (step 2 saved on schedule)"
    assert f"checkpoint-{stopped}" in resume_lines[0]
    assert (cut / f"checkpoint-{stopped}" / "trainer_state.json").exists() and not (cut / "final").exists()
    assert sorted(rows(cut)) == list(range(1, stopped + 1))  # metrics.csv of what ran

    resumed = run_train([*ARGS, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {cut / f'checkpoint-{stopped}'}" in resumed.stdout
    a, b = rows(full), rows(cut)
    assert sorted(b) == list(range(1, 7))  # zero steps lost
    for step in range(1, 7):
        for key in KEYS:
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-8), (step, key)


@pytest.mark.distributed
def test_sigterm_to_a_two_process_deepspeed_launch(tmp_path):
    """`accelerate launch` (2 processes, ZeRO-2 over gloo) gets SIGTERM as a scheduler sends it: torch's agent forwards
    it to both ranks, which agree on the step, save every rank's files into one checkpoint and leave before the
    agent's SIGKILL; the launch resumed from it logs what an uninterrupted launch logs."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    launcher = [accelerate, "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "cpu_zero2.yaml")]
    args = ["--eval_size", "0", "--max_steps", "6", "--save_steps", "2", "--rewards", "support.rewards:length_reward"]
    full = tmp_path / "full"
    done = run_train([*args, "--output_dir", str(full)], launcher=launcher, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]

    cut = tmp_path / "cut"
    cmd = [*launcher, os.path.join(ROOT, "launch", "train.py"), *args, "--output_dir", str(cut)]
    rc, stdout, stderr = sigterm_after(cmd, cut / "checkpoint-2" / "trainer_state.json", child_env())
    # The ranks exit 0; torch's agent re-raises the signal as SignalException whatever they did, so the launcher
    # exits non-zero. Neither rank raised or had to be SIGKILLed after the agent's grace period.
    assert stderr.count("SIGTERM received") == 2, stderr[-3000:]
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr
    assert "Unable to shutdown process" not in stderr
    stopped = max(int(p.name.split("-")[1]) for p in cut.glob("checkpoint-*"))
    assert 2 < stopped < 6, rc
    saved = cut / f"checkpoint-{stopped}"
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {p.name for p in saved.iterdir()}
    assert sum("--resume_from_checkpoint latest" in line for line in stdout.splitlines()) == 1  # rank 0 says it

    resumed = run_train([*args, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"], launcher=launcher,
                        timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = rows(full), rows(cut)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        for key in KEYS:
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-8), (step, key)


def test_sigterm_to_a_one_process_accelerate_launch_reaches_the_trainer(tmp_path):
    """accelerate's one-process launcher has no SIGTERM handler: it dies at once. The trainer asked the kernel for
    SIGTERM on its parent's death (PR_SET_PDEATHSIG), so it still finishes its step, saves and says how to resume."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "one"
    cmd = [accelerate, "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "cpu.yaml"),
           os.path.join(ROOT, "launch", "train.py"), *ARGS, "--output_dir", str(out)]
    rc, stdout, stderr = sigterm_after(cmd, out / "checkpoint-2" / "trainer_state.json", child_env())
    assert rc == -signal.SIGTERM  # the launcher; communicate() returned once the trainer closed its pipes too
    assert "SIGTERM received" in stderr and "--resume_from_checkpoint latest" in stdout, (
        stdout[-2000:], stderr[-2000:])
    stopped = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert 2 < stopped < 6 and (out / f"checkpoint-{stopped}" / "trainer_state.json").exists()
