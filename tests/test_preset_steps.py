"""Each GPU preset's code path runs on CPU: one GRPO step with the preset's own settings, scaled down.

A tiny random model of the preset's architecture family (fp32, no 4-bit), 8-token completions, no held-out
evaluation; everything else is the preset's: G, micro-batch and accumulation, LoRA rank (or full fine-tuning),
gradient checkpointing, activation offload (copy path forced), log-prob head, padding-free rows, rope scaling,
the colocated-engine request (which falls back to generate() here with one line). DeepSpeed presets run their
single-process path (no sequence parallelism with one process); the 2-process ZeRO and Ulysses launches are
tests/test_distributed.py's and tests/test_sequence_parallel.py's. A vLLM-server preset generates with generate()
here (--use_vllm false: no server on CPU).

    OMP_NUM_THREADS=1 pytest tests/test_preset_steps.py
"""

import json

import pytest

from grpo_accel.app import presets
from grpo_accel.app.presets import PRESETS
from grpo_accel.app.run_spec import resolve_run_spec
from grpo_accel.app.runner import run

FAMILY = {"llama": "tiny-llama", "smollm2": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3",
          "gpt-oss": "tiny-gpt-oss"}
GPU_PRESETS = [n for n, p in PRESETS.items() if p.is_gpu]


def tiny_model_for(preset) -> str:
    return next(tiny for prefix, tiny in FAMILY.items() if preset.architecture.startswith(prefix))


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_runs_one_step_scaled_down(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")  # the real stash/copy/restore path on CPU
    monkeypatch.setattr(presets, "check_preset_fits_gpu", lambda preset, gpu_props="current": None)
    preset = PRESETS[name]
    out = tmp_path / name
    spec = resolve_run_spec(["--preset", name, "--model", tiny_model_for(preset), "--model_dtype", "float32",
                             "--quantization", "none", "--bf16", "false", "--fp16", "false",
                             "--max_completion_length", "8", "--train_size", "8", "--eval_size", "0",
                             "--max_steps", "1", "--save_steps", "100", "--output_dir", str(out),
                             *(["--use_vllm", "false"] if preset.vllm_mode == "server" else []),
                             # one process runs no SP, and the tiny models' 4 heads do not split 8 ways
                             *(["--sequence_parallel_size", "1"] if preset.sequence_parallel_size > 1 else [])])
    assert spec.preset.name == name
    assert run(spec) == 0
    logged = capsys.readouterr().out
    cfg = json.loads((out / "resolved_config.json").read_text())["config"]
    # the preset's own settings reached the run
    assert cfg["num_generations"] == preset.num_generations
    assert cfg["per_device_train_batch_size"] == preset.per_device_train_batch_size
    assert cfg["gradient_accumulation_steps"] == preset.gradient_accumulation_steps
    assert cfg["learning_rate"] == presets.GPU_RECIPE["learning_rate"]
    assert ("activation offload: on" in logged) == (preset.offload_activations == "true")
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) >= 2 and "loss" in rows[0]
