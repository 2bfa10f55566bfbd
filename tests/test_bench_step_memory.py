"""Smoke test of benchmarks/bench_step_memory.py at a tiny size (~40 s on one core): three variants, CSV shape."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_step_memory.py"
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


@pytest.mark.long  # ~55 s on 2 cores: the benchmark script end to end
def test_tiny_step_writes_long_csv_and_plot(tmp_path):
    """ours_head_offload, ours_mb1 and trl_tuned (micro-batch 1 + gradient accumulation, transformers' offload):
    padded completions of unequal length; accumulating one row at a time gives the loss of the whole batch."""
    out = tmp_path / "step.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    impls = ["ours_head_offload", "ours_mb1", "trl_tuned"]
    cmd = [sys.executable, str(SCRIPT), "--arch", "tiny-llama", "--num-generations", "2", "--prompt-length", "4",
           "--completion-length", "8", "--reps", "1", "--impls", *impls, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == FIELDS
        rows = list(reader)
    got = {i: {r["metric"]: float(r["value"]) for r in rows if r["impl"] == i} for i in impls}
    assert {r["op"] for r in rows} == {"grpo_step_fwd_bwd"}
    assert rows[0]["shape"] == "tiny-llama,lora-r16,G=2,P=4,T=8,fp32,padded" and rows[0]["device"].startswith("cpu")
    for impl, m in got.items():
        assert m["oom"] == 0 and m["checkpointing"] == 1 and m["host_is_device"] == 1, impl
        assert m["step_time_ms"] > 0 and m["peak_step_mem_mib"] > 0 and math.isfinite(m["loss"]), impl
        # rows of 4 + 4 and 4 + 8 real tokens
        assert m["time_per_token_us"] == pytest.approx(m["step_time_ms"] * 1e3 / 20, rel=1e-3), impl
        assert m["peak_step_mem_with_weights_mib"] > m["peak_step_mem_mib"], impl
    assert got["ours_head_offload"]["offloaded_peak_mib"] > 0, "forced copies on CPU: the stash held host bytes"
    assert got["ours_mb1"]["loss"] == pytest.approx(got["ours_head_offload"]["loss"], rel=1e-5)
    assert got["ours_mb1"]["lora_grad_norm"] == pytest.approx(got["ours_head_offload"]["lora_grad_norm"], rel=1e-4)
    assert got["trl_tuned"]["loss"] == pytest.approx(got["ours_head_offload"]["loss"], rel=1e-4)
    assert out.with_suffix(".png").stat().st_size > 0


def test_qlora_without_cuda_skips_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_step_memory

    monkeypatch.setattr(sys, "argv", ["bench", "--quant", "4bit", "--device", "cpu", "--out", str(tmp_path / "x.csv")])
    bench_step_memory.main()
    assert "skipped: --quant 4bit (QLoRA) needs a CUDA GPU and bitsandbytes" in capsys.readouterr().out
    assert not (tmp_path / "x.csv").exists()


def test_find_max_t_first_probe_is_the_planners(monkeypatch):
    """On CUDA the first probe is the planner's longest T for the impl (so a 256K search costs few probes): ours at
    micro-batch 1 plans >= 2x trl_tuned's on an 80 GB GPU with 110 GiB of host memory, trl far less."""
    import argparse
    import types

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_step_memory

    from grpo_accel.offload import residency

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=79 << 30))
    monkeypatch.setattr(residency, "host_available_bytes", lambda: 110 << 30)
    args = argparse.Namespace(device="cuda", arch="qwen3-8b", quant="4bit", num_generations=8, prompt_length=64,
                              t_step=1024)
    planned = {impl: bench_step_memory.planned_max_t(args, impl) for impl in ("trl", "trl_tuned", "ours_mb1")}
    assert planned["ours_mb1"] >= 2 * planned["trl_tuned"] > 0 and planned["trl"] < planned["trl_tuned"]
    assert all(t % 1024 == 0 for t in planned.values())
    assert bench_step_memory.planned_max_t(argparse.Namespace(device="cpu"), "trl") == 0
