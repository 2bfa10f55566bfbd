"""benchmarks/gpu_presets.py's plumbing without a GPU: save a random model, launch the preset through
`accelerate launch`, read the run's telemetry and the planner's prediction into the long-format CSV.

    OMP_NUM_THREADS=1 pytest tests/test_gpu_presets_script.py
"""

import csv
import os
import subprocess
import sys

import pytest
from support.launch import ROOT, child_env


@pytest.mark.long  # the benchmark script end to end (41 s): make test-distributed, as bench_step_memory
def test_gpu_presets_cpu_check_writes_the_csv(tmp_path):
    csv_path = tmp_path / "presets.csv"
    # as on an offline GPU host: no hub, no registry, no embedded model in the cache (issue 35): nothing downloads
    offline = dict(child_env(), HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", GRPO_ACCEL_CACHE=str(tmp_path / "no_cache"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_presets.py"), "--cpu-check",
                           "--completion-length", "8", "--out", str(tmp_path / "out"), "--models-dir",
                           str(tmp_path / "models"), "--csv", str(csv_path)], env=offline, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["metric"]: r for r in csv.DictReader(csv_path.open())}
    assert rows["completed"]["value"] == "1.0" and rows["completion_length_run"]["value"] == "8"
    assert float(rows["peak_allocated_gib"]["value"]) > 0.1  # the launched run's own telemetry (host RSS on CPU)
    assert float(rows["predicted_reserved_gib"]["value"]) > 0 and "T=" in rows["completed"]["shape"]
    assert csv_path.with_suffix(".png").exists()
    assert (tmp_path / "models" / "tiny-llama" / "config.json").exists()
    assert not (tmp_path / "no_cache").exists()  # the embedded model was never fetched


def test_gpu_presets_refuses_to_run_gpu_presets_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_presets.py"), "--out",
                           str(tmp_path)], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: no CUDA GPU here" in proc.stderr
