"""An install that is not the checkout: `pip wheel .` installed into a folder of its own has its presets (the YAMLs
are package data), `grpo-accel presets` and `grpo-accel plan` work from it, and launch/train.py copied alone trains
one step with --preset.

    pytest -m long tests/test_wheel.py
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder holding only the built wheel's files, environment that imports grpo_accel from it)."""
    pytest.importorskip("setuptools")  # built without isolation: no index needed
    tmp = tmp_path_factory.mktemp("wheel")
    # a clean copy of the sources: an in-tree build reuses build/lib, where files from an earlier build would hide a
    # missing package-data rule
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "runs", "wandb", "*.egg-info", "__pycache__", "tests", "benchmarks", "docs"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("grpo_accel-*.whl"))
    site = tmp / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return site, env


def _python(code: str, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_wheel_has_its_presets(installed, tmp_path):
    site, env = installed
    yamls = sorted(p.name for p in (site / "grpo_accel" / "app" / "presets" / "accelerate_configs").glob("*.yaml"))
    assert yamls == sorted(p.name for p in (ROOT / "accelerate_configs").glob("*.yaml")) and "h100_110k.yaml" in yamls
    code = ("import grpo_accel, sys\n"
            "from grpo_accel.app.presets import PRESETS\n"
            "from grpo_accel.app.cli import main\n"
            "print('FILE', grpo_accel.__file__)\n"
            "print('YAML', PRESETS['h100_110k'].yaml_path, PRESETS['h100_110k'].yaml_path.is_file())\n"
            "assert main(['presets']) == 0\n"
            "sys.exit(main(['plan', '--preset', 'h100_110k', '--stack', 'pinned']))\n")
    out = _python(code, env, tmp_path)  # not the checkout's folder: nothing of it on sys.path
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"FILE {site}" in out.stdout and f"YAML {site}" in out.stdout and " True" in out.stdout
    assert "h100_110k.yaml" in out.stdout and "fits: predicted peak" in out.stdout


def test_train_script_alone_takes_a_preset(installed, tmp_path):
    _, env = installed
    script = tmp_path / "train.py"
    shutil.copy(ROOT / "launch" / "train.py", script)  # its sys.path insert finds no checkout next to it
    proc = subprocess.run([sys.executable, str(script), "--preset", "cpu", "--model", "tiny-llama", "--max_steps", "1",
                           "--train_size", "4", "--eval_size", "0", "--num_generations", "2",
                           "--per_device_train_batch_size", "2", "--max_completion_length", "8", "--report_to", "none",
                           "--output_dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "preset cpu: --preset cpu on the command line" in proc.stdout
    assert (tmp_path / "run" / "summary.json").is_file()
