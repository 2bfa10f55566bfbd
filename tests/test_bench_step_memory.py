"""benchmarks/bench_step_memory.py's parts. The script end to end (three variants at a tiny size, the CSV, the plot,
equal losses) runs as the campaign's row step_32k: tests/test_gpu_campaign.py's --cpu-check test reads its CSV."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_step_memory.py"
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


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
