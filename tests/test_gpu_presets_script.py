"""benchmarks/gpu_presets.py without a GPU: it refuses the GPU presets. Its CPU run (a random model saved, the preset
launched through `accelerate launch`, the run's telemetry and the planner's prediction in the long-format CSV) is
the campaign's row preset_cpu, checked in tests/test_gpu_campaign.py's --cpu-check test.

    OMP_NUM_THREADS=1 pytest tests/test_gpu_presets_script.py
"""

import os
import subprocess
import sys

import pytest
from support.launch import ROOT, child_env


def test_gpu_presets_refuses_to_run_gpu_presets_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_presets.py"), "--out",
                           str(tmp_path)], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: no CUDA GPU here" in proc.stderr
