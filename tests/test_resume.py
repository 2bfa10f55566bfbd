"""Kill a run with SIGKILL mid-training, resume with `--resume_from_checkpoint latest`: the steps after the
checkpoint log the same loss and reward as an uninterrupted run with the same seed."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from support.launch import ROOT, TINY_ARGS, child_env, run_train, train

ARGS = [*TINY_ARGS, "--max_steps", "4", "--save_steps", "2", "--eval_size", "0", "--save_total_limit", "3",
        "--rewards", "support.rewards:length_reward"]


def rows(out):
    return {int(float(r["step"])): r for r in csv.DictReader(open(out / "metrics.csv"))}


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    full = tmp_path / "full"
    assert run_train([*ARGS, "--output_dir", str(full)]).returncode == 0

    killed = tmp_path / "killed"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *ARGS, "--output_dir", str(killed)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = killed / "checkpoint-2" / "trainer_state.json"
    deadline = time.time() + 300
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists(), "the run ended before its first checkpoint"
    assert not (killed / "final").exists()
    # A save interrupted by the kill: a newer checkpoint directory without its trainer state.
    partial = killed / "checkpoint-3"
    if not (partial / "trainer_state.json").exists():
        partial.mkdir(exist_ok=True)
        (partial / "adapter_model.safetensors").write_bytes(b"truncated")

    resumed = run_train([*ARGS, "--output_dir", str(killed), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    a, b = rows(full), rows(killed)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-8), (step, key)


def test_resume_without_checkpoint_names_the_fix(tmp_path, capsys):
    code, _, err = train([*ARGS, "--output_dir", str(tmp_path / "none"), "--resume_from_checkpoint", "latest"], capsys)
    assert code == 2 and "no complete checkpoint" in err
    assert not (tmp_path / "none").exists()
