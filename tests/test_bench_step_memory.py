"""Smoke test of benchmarks/bench_step_memory.py at a tiny size (~15 s on one core): one variant, CSV shape."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_step_memory.py"
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


def test_tiny_step_writes_long_csv_and_plot(tmp_path):
    out = tmp_path / "step.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(SCRIPT), "--arch", "tiny-llama", "--num-generations", "2", "--prompt-length", "4",
           "--completion-length", "8", "--reps", "1", "--impls", "ours_head_offload", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == FIELDS
        rows = list(reader)
    got = {r["metric"]: float(r["value"]) for r in rows}
    assert {r["impl"] for r in rows} == {"ours_head_offload"}
    assert {r["op"] for r in rows} == {"grpo_step_fwd_bwd"}
    assert rows[0]["shape"] == "tiny-llama,lora-r16,G=2,P=4,T=8,fp32" and rows[0]["device"].startswith("cpu")
    assert got["oom"] == 0 and got["checkpointing"] == 1 and got["host_is_device"] == 1
    assert got["step_time_ms"] > 0 and got["peak_step_mem_mib"] > 0 and math.isfinite(got["loss"])
    assert got["offloaded_peak_mib"] > 0, "forced copies on CPU: the stash must have held bytes on the host"
    assert out.with_suffix(".png").stat().st_size > 0


def test_qlora_without_cuda_skips_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_step_memory

    monkeypatch.setattr(sys, "argv", ["bench", "--quant", "4bit", "--device", "cpu", "--out", str(tmp_path / "x.csv")])
    bench_step_memory.main()
    assert "skipped: --quant 4bit (QLoRA) needs a CUDA GPU and bitsandbytes" in capsys.readouterr().out
    assert not (tmp_path / "x.csv").exists()
