"""benchmarks/gpu_campaign.py: rows in order, each in its own process group with its own limit, the ledger that
resumes a campaign across GPU loans, and the summary.

    OMP_NUM_THREADS=1 pytest tests/test_gpu_campaign.py            # the plumbing with stand-in scripts (seconds)
    OMP_NUM_THREADS=1 pytest tests/test_gpu_campaign.py -m long    # --cpu-check twice: every real script, tiny sizes
"""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_utils import ROOT, child_env

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_campaign as gc  # noqa: E402

# Stand-ins for benchmark scripts: one writes a long-format row; one starts a worker and hangs, as a stuck step does.
WRITES = """import sys, results_io
out = sys.argv[sys.argv.index("--out") + 1]
results_io.write_results([dict(op="x", impl="a", shape="s,", metric="value", value="1.5", unit="u")],
                         __import__("pathlib").Path(out), ("v", "abc", "dev"))
"""
HANGS = """import subprocess, sys, time
print("stuck: a step that never ends", flush=True)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[sys.argv.index("--out") + 1] + ".pid", "w").write(str(worker.pid))
time.sleep(600)
"""


def judge(view):
    got = view.m("a")
    return (f"value {got['value']:g}", "met" if got.get("value") == 1.5 else "missed") if got else ("", "")


def stand_in_rows(tmp_path, limit_s=2):
    scripts = {}
    for name, text in (("writes", WRITES), ("hangs", HANGS)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    row = lambda name, script, **kw: gc.Row(name, f"measures {name}", f"goal {name}", 999, str(script),  # noqa: E731
                                            f"{name}.csv", "x", judge, cpu_limit_s=limit_s, **kw)
    return [row("first", scripts["writes"]), row("stuck", scripts["hangs"]),
            row("missing", tmp_path / "bench_not_yet.py"), row("last", scripts["writes"])]


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan stays one until its new parent, maybe a container's init, reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


META = dict(cpu=True, versions="v", sha="abc", device="dev", date="2026-01-01")


def ledger(results, sha=None):
    return {(r["impl"], r["metric"]): float(r["value"]) for r in csv.DictReader((results / gc.LEDGER).open())
            if sha is None or r["git_sha"] == sha}


def test_rows_run_in_order_a_hang_is_killed_and_a_rerun_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "benchmarks"))  # the stand-ins import results_io
    rows, results = stand_in_rows(tmp_path), tmp_path / "results"
    t0 = time.monotonic()
    entries = gc.run_campaign(rows, [("preset_big", "needs more memory")], META, results, tmp_path / "logs",
                              tmp_path / "models")
    assert time.monotonic() - t0 < 30  # the stuck row cost its 2 s limit, not 600
    got = ledger(results)
    assert got[("first", "exit_code")] == 0 and got[("last", "exit_code")] == 0  # the row after the hang ran
    assert got[("stuck", "timed_out")] == 1 and ("missing", "exit_code") not in got
    worker = int((results / "stuck.csv.pid").read_text())
    time.sleep(0.2)
    assert not running(worker)  # the hung row's own worker went with it (on a GPU it would hold the memory)
    states = {e["name"]: (e["state"], e["measured"], e["verdict"]) for e in entries}
    assert states["first"][0].startswith("done in") and states["first"][1:] == ("value 1.5", "met")
    assert states["stuck"][0] == "timed out at its limit, 2 s" and states["missing"][0] == "script not present yet"
    page = (results / gc.SUMMARY).read_text()
    assert all(f"| {name} |" in page for name in ("first", "stuck", "missing", "last"))
    assert "device: dev; versions: v; git sha: abc" in page and "preset_big (needs more memory)" in page

    assert "## Failures" in page and "stuck: a step that never ends" in page  # the failed row's log tail

    (tmp_path / "writes.py").write_text("raise SystemExit('ran again')")  # a rerun must not start a done row
    gc.run_campaign(rows, [], META, results, tmp_path / "logs", tmp_path / "models", skip_failed=True)
    assert ledger(results) == got  # --skip-failed: the timed-out row left too
    gc.run_campaign(rows, [], META, results, tmp_path / "logs", tmp_path / "models")
    again = ledger(results)
    assert again[("stuck", "attempts")] == 2 and again[("stuck", "timed_out")] == 1  # failed is not done: retried
    assert {k: v for k, v in again.items() if k[0] != "stuck"} == {k: v for k, v in got.items() if k[0] != "stuck"}
    got = again
    gc.run_campaign(rows, [], dict(META, sha="def"), results, tmp_path / "logs", tmp_path / "models")
    assert ledger(results, "abc") == got  # the old sha's record stays
    new = ledger(results, "def")
    assert new[("first", "exit_code")] == 1 and new[("last", "exit_code")] == 1  # a new sha runs every row again


def test_budget_stops_before_a_row_that_would_not_finish(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "benchmarks"))
    rows, results = stand_in_rows(tmp_path, limit_s=20), tmp_path / "results"
    gc.run_campaign(rows, [], META, results, tmp_path / "logs", tmp_path / "models", budget_s=10)
    assert "stopped before first: its limit is 20 s" in capsys.readouterr().out
    assert not (results / gc.LEDGER).exists()
    assert "| first | measures first | goal first | pending |" in (results / gc.SUMMARY).read_text()


def test_every_row_has_a_shape_its_script_writes_and_a_limit_under_a_loan():
    """The shape prefix a judge filters on is the one the script writes (bench_step_memory's _shape), and no row's
    limit reaches a 10-minute loan."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import argparse

    import bench_step_memory

    rows, _ = gc.campaign_rows(False, None)
    for row in rows:
        assert row.limit_s <= 570, row.name
        if row.script == "bench_step_memory.py" and "--find-max-t" not in row.args:
            s = row.gpu
            args = argparse.Namespace(arch=s["arch"], quant=s.get("quant", "none"), device="cuda", t_step=1024,
                                      num_generations=s["num_generations"], prompt_length=s["prompt_length"],
                                      equal_lengths=False)
            assert bench_step_memory._shape(args, s["completion_length"]).startswith(row.shape_prefix(False))


@pytest.mark.slow
@pytest.mark.long  # 2 min 53 s measured for one --cpu-check on 2 busy cores: make test-distributed
def test_cpu_check_twice_runs_every_script_then_skips_every_row(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_campaign.py"), "--cpu-check", "--results",
           str(results)]
    first = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    rows, _ = gc.campaign_rows(True, None)
    present = [r.name for r in rows if r.script_path().exists()]
    got = ledger(results)
    assert all(got[(name, "exit_code")] == 0 for name in present), got  # every real script, its GPU flags
    page = (results / gc.SUMMARY).read_text()
    for row in rows:
        assert f"| {row.name} |" in page
    for name in present:  # each judge found its row's figures in its CSV at this sha
        line = next(ln for ln in page.splitlines() if f"| {name} |" in ln)
        assert "| done in" in line and line.endswith("| cpu check: no goal |"), line
    for png in ("step_memory.png", "packing.png", "presets_gpu.png"):
        assert (results / png).stat().st_size > 0

    again = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    skipped = [ln for ln in again.stdout.splitlines() if ": skipped, in the ledger" in ln]
    assert len(skipped) == len(present) and ledger(results) == got
    assert (results / gc.SUMMARY).read_text() == page  # nothing ran, nothing changed
