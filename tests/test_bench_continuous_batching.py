"""benchmarks/bench_continuous_batching.py at tiny sizes (--cpu-check, one length): both routes' figures reach the
long-format CSV, and --resume measures nothing twice. ~30 s on one core (two processes importing transformers).

    OMP_NUM_THREADS=1 pytest -m long tests/test_bench_continuous_batching.py

Memory is checked for presence only: at these sizes paged's peak is above generate()'s, not below (its pool is whole
256-token pages: 2 x 1 page of 45 KiB/token for 2 x 16 tokens, ~60 MiB against generate()'s ~1 MiB of cache), so the
comparison the benchmark exists for needs its real sizes (docs/measurements.md).
"""

import csv
import subprocess
import sys

import pytest
from support.launch import ROOT, child_env

SCRIPT = f"{ROOT}/benchmarks/bench_continuous_batching.py"


def run(*argv):
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-check", "--variants", "paged", "generate",
                           "--completion-lengths", "8", *argv], env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


@pytest.mark.long  # the benchmark script end to end (~50 s, three processes): make test-distributed, as the others
def test_cpu_check_writes_both_routes_figures_and_resume_skips_them(tmp_path):
    out = tmp_path / "cb.csv"
    run("--out", str(out))
    rows = list(csv.DictReader(out.open()))
    got = {(r["impl"], r["metric"]): float(r["value"]) for r in rows}
    assert {r["op"] for r in rows} == {"cb_generation"} and len({r["shape"] for r in rows}) == 1
    for impl in ("paged", "generate"):
        assert got[(impl, "decode_tok_s_8")] > 0
        assert got[(impl, "tokens_8")] == 2 * 8  # G x C: EOS stayed off on both routes
        assert got[(impl, "peak_gib_8")] >= 0 and got[(impl, "plan_gib_8")] > 0
    assert got[("paged", "plan_pool_gib_8")] > 0 and all(r["git_sha"] and r["device"] for r in rows)
    assert out.with_suffix(".png").exists()
    again = run("--out", str(out), "--resume")
    assert again.count("(--resume)") == 2 and len(list(csv.DictReader(out.open()))) == len(rows)
