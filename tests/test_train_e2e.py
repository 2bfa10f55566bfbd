"""The product end to end: a tiny model trained 2 GRPO steps through launch/train.py, and bad input."""

import csv
import json
import math
import os
import re
import sys

import pytest
from safetensors.torch import load_file
from support.launch import TINY_ARGS, error_line, run_train, train

from grpo_accel.app.tracking import read_wandb_history


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny"
    # -X importtime: each module the run imports, a line on stderr (test_a_run_that_does_not_quantize_...)
    result = run_train([*TINY_ARGS, "--output_dir", str(out), "--run_name", "tiny", "--report_to", "wandb",
                        "--rewards", "support.rewards:length_reward_that_warns,format"],
                       launcher=[sys.executable, "-X", "importtime"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_no_upstream_warning_before_our_first_line_and_the_runs_own_still_show(tiny_run):
    """TRL's default trips transformers' `gradient_checkpointing` deprecation in every config, and the stack prints
    lines nobody can act on (core/upstream_noise.py: bitsandbytes' hub kernel on CPUs with AVX512-BF16, DeepSpeed's
    CPU accelerator, TRL's read of a deprecated property, torch's pinning without CUDA): none reaches the screen. The
    filters are those messages: a warning the run's own code raises still shows."""
    from grpo_accel.core.upstream_noise import LOG_RECORDS, WARNINGS

    _, result = tiny_run
    assert "`gradient_checkpointing` is deprecated" not in result.stderr
    for pattern in [p for _, p in LOG_RECORDS] + [p for _, p in WARNINGS]:
        assert not re.search(pattern, result.stderr), pattern
    assert "support.rewards: a warning of the run's own" in result.stderr
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("[grpo_accel]"))
    assert not [line for line in lines[:first] if "warn" in line.lower()], lines[:first]


def test_a_run_that_does_not_quantize_never_imports_bitsandbytes(tiny_run):
    """peft imports bitsandbytes wherever it is installed; a LoRA run without 4-bit weights hides it for its process
    (app/bitsandbytes_gate.py). Its import-time log names every module the run imported, peft's included."""
    _, result = tiny_run
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert "peft" in imported, "the import log is not there: the check would pass on anything"
    # peft's `import bitsandbytes` is still tried and logged (a few µs, refused); the package itself imports its
    # submodules (bitsandbytes.nn, .functional, ...) as it loads
    assert not {m for m in imported if m.startswith("bitsandbytes.")}


def test_two_steps_log_loss_and_reward_and_change_parameters(tiny_run):
    out, _ = tiny_run
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(float(r["step"])) for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(float(row["loss"])) and math.isfinite(float(row["reward"]))
        assert math.isfinite(float(row["grad_norm"]))
    assert any(float(r["reward_std"]) > 0 for r in rows), "no reward variance: the test would not train"
    # (no logps_no_grad phase here: with beta=0 and one iteration TRL skips the old/ref passes)
    for phase in ("generation", "policy_forward", "backward", "optimizer_step"):
        assert all(float(r[f"memory/{phase}_peak_gib"]) > 0 for r in rows), phase
    assert all(float(r["memory/host_rss_gib"]) > 0 for r in rows)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.isfinite().all() for v in adapter.values())
    assert max(v.abs().max().item() for v in lora_b) > 0, "LoRA B starts at zero: training must move it"
    summary = json.load(open(out / "summary.json"))
    assert summary["steps"] == 2 and summary["seconds_per_step"] > 0
    assert set(summary["before"]) == {"accuracy_strict", "accuracy_lenient"}
    for name in ("reward_curve.png", "resolved_config.json", "heldout_before.json", "heldout_after.json"):
        assert (out / name).stat().st_size > 0


def test_each_line_is_said_once(tiny_run):
    """One home per message: no line of ours twice in a run (share_prompt's was said by the runner and the trainer),
    and the one share_prompt line carries what sharing does at this dataset's longest prompt."""
    _, result = tiny_run
    lines = [line for line in result.stdout.splitlines() if line.startswith("[grpo_accel]")]
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1]
    shared = [line for line in lines if "share_prompt=" in line]
    assert len(shared) == 1 and "this dataset's longest prompt" in shared[0], shared


def test_wandb_offline_metrics_read_back(tiny_run):
    out, result = tiny_run
    history = [r for r in read_wandb_history(str(out)) if "train/loss" in r]
    csv_rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(history) == 2
    for logged, row in zip(history, csv_rows):
        assert logged["train/global_step"] == int(float(row["step"]))
        assert logged["train/reward"] == pytest.approx(float(row["reward"]), rel=1e-6)
        assert logged["train/loss"] == pytest.approx(float(row["loss"]), rel=1e-6, abs=1e-12)
        assert logged["train/memory/backward_peak_gib"] == pytest.approx(float(row["memory/backward_peak_gib"]))


@pytest.mark.parametrize("args,message", [
    (["--model", "no-such-org/no-such-model"], "could not be loaded from the hub.*Fix"),
    (["--model", "./missing_model_dir"], "does not exist.*Fix"),
    (["--dataset", "/nonexistent/data.jsonl"], "does not exist.*Fix"),
    (["--rewards", "nope_reward"], "neither built in.*Fix"),
    (["--preset", "no_such_preset"], "no_such_preset"),
    (["--preset", "h100_110k"], "needs a CUDA GPU.*try cpu"),
    (["--quantization", "4bit"], "4-bit"),
])
def test_bad_input_fails_fast_with_the_fix(tmp_path, args, message, capsys):
    """launch/train.py's main in this process (support.launch.train: the same code path without ~12 s of imports a
    case; test_new_user.py checks the error path through a real `accelerate launch` process)."""
    out = tmp_path / "run"
    code, _, err = train([*TINY_ARGS, "--output_dir", str(out), *args], capsys)
    assert code == 2, err[-2000:]
    assert re.search(message, error_line(err))
    assert not out.exists(), "a run that never started must leave no run directory"


def test_dataset_without_fields(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1", "solution": "2"}\n')
    code, _, err = train([*TINY_ARGS, "--output_dir", str(tmp_path / "run"), "--dataset", str(data)], capsys)
    assert code == 2 and "no 'prompt' column, nor 'question' and 'answer'" in error_line(err)


def test_reward_that_raises_is_named(tmp_path, capsys):
    code, _, err = train([*TINY_ARGS, "--output_dir", str(tmp_path / "run"), "--eval_size", "0",
                          "--rewards", "support.rewards:broken_reward"], capsys)
    assert code == 2
    assert "reward function 'broken_reward' raised KeyError" in error_line(err)


def test_report_renders_the_run(tiny_run):
    from grpo_accel.app.cli import main

    out, _ = tiny_run
    os.remove(out / "reward_curve.png")
    assert main(["report", str(out)]) == 0
    for name in ("reward_curve.png", "rewards.png", "completion_length.png", "memory_phases.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
