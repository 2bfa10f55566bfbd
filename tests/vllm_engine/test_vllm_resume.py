"""--resume_from_checkpoint with the colocated engine: the engine holds the resumed adapter before it generates.

A fresh engine starts with the bare base weights; if nothing pushed the resumed adapter, the first resumed batch
would be sampled from the base model and scored by the trainer with the adapter (TRL #3148, Unsloth #4196).
`make test-vllm`, or: .venv-vllm/bin/python -m pytest -q tests/vllm_engine/test_vllm_resume.py
"""

import json
import os
import sys

import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import THREADS, report, trainer_check  # noqa: E402
from support.launch import ROOT, child_env, run_process_group  # noqa: E402

RUN_SCRIPT = os.path.join(os.path.dirname(__file__), "resume_run.py")


def phase(name: str, out_dir, model_dir: str) -> dict:
    proc = run_process_group([sys.executable, RUN_SCRIPT, name, str(out_dir), model_dir], 840, cwd=ROOT,
                             env=child_env(OMP_NUM_THREADS=THREADS, GRPO_ACCEL_VLLM_THREADS=THREADS))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESUME_RUN ")][-1]
    return json.loads(line[len("RESUME_RUN "):])


def test_engine_holds_the_resumed_adapter_before_first_generation(tmp_path, tiny_model_dir):
    trainer_check("the adapter push it relies on is checked on both lines by test_vllm_colocate.py's "
                 "test_adapter_sync_after_optimizer_steps; the resume is the trainer's")
    trained = phase("train", tmp_path, tiny_model_dir)
    assert trained["shared"] and trained["global_step"] == 2
    assert (tmp_path / "checkpoint-2" / "adapter_model.safetensors").exists()

    resumed = phase("resume", tmp_path, tiny_model_dir)
    assert resumed["shared"] and resumed["first_generation_at_step"] == 2 and resumed["global_step"] == 3
    assert resumed["steps_logged"] == [1, 2, 3]  # the checkpoint's history, then the resumed step
    agree, stale = resumed["first_generation_with_engine_adapter"], resumed["first_generation_bare_base"]
    assert agree < 1e-4, "the engine generated the first resumed batch without the resumed adapter"
    assert stale > 10 * agree, "the resumed adapter is too close to the base for this test to prove anything"
    report(f"resume: engine vs trainer log-probs at the first resumed generation {agree:.1e} (bare base {stale:.1e})")
    # The push after every optimizer step, 120 times over: flat (a leak of one adapter per push, 0.2 MiB of fp32
    # tensors on the tiny model, would be 20 MiB per 100).
    slope = resumed["push_slope_bytes_per_100"]
    report(f"adapter push: malloc in-use slope {slope / 2**20:+.3f} MiB per 100 pushes")
    assert slope <= 2**20, "the in-memory adapter push leaks"
