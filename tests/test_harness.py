"""benchmarks/harness.py, the scaffolding every benchmark script stands on: a worker process's re-entry and its result
line, a failed worker as a result, the CSV a run appends to and resumes from, and the plot. A stand-in script, no
model: ~2 s. The real scripts run on it in the campaign's --cpu-check (tests/test_gpu_campaign.py, long)."""

import csv
import os
import sys
import textwrap

import pytest
from support.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import harness  # noqa: E402

SCRIPT = textwrap.dedent('''
    import sys
    sys.path.insert(0, {bench!r})
    import harness

    def worker(args):
        if args.worker == "oom":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        if args.worker == "broken":
            raise ValueError("a bug of our own")
        return {{"impl": args.worker, "tokens": args.tokens * 2}}

    p = harness.parser(__doc__, worker=("ok", "oom", "broken"))
    p.add_argument("--tokens", type=int)
    harness.parse(p, None, worker)
    print("a worker never gets here")
''')


def test_a_worker_reenters_its_script_and_answers_with_one_result(tmp_path):
    script = tmp_path / "bench_stand_in.py"
    script.write_text(SCRIPT.format(bench=os.path.join(ROOT, "benchmarks")))
    flags = harness.cli_flags(dict(tokens=21, equal_lengths=False, preset=None))
    assert flags == ["--tokens", "21"]  # None and False left out
    assert harness.run_worker(script, flags, "ok") == {"impl": "ok", "tokens": 42}
    # out of memory outside the step: a row (oom=1), not a crash; a bug of our own stops the benchmark
    oom = harness.run_worker(script, flags, "oom")
    assert oom["oom"] and harness.failure_metrics(oom) == [("oom", 1.0, "bool")]
    with pytest.raises(SystemExit, match="broken T=8 failed"):
        harness.run_worker(script, flags, "broken", label="T=8")


def test_results_append_each_variant_resume_it_and_fail_a_killed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_ACCEL_GIT_SHA", "abc")
    out, meta = tmp_path / "packing.csv", ("torch=2", "abc", "cpu (test)")  # packing: a card needs a known writer
    plots = []

    def plot(rows, png):
        harness.grouped_bars(rows, png, [("step_time_ms", "step (ms)"), ("loss", "loss")], group=lambda r: r["shape"],
                             series=lambda r: r["impl"])
        plots.append(png)

    run = harness.Results(out, meta, plot, resume=True)
    for impl, res in (("padded", dict(oom=False)), ("packed", dict(oom=True))):
        metrics = harness.failure_metrics(res) + ([] if harness.failed(res) else [("step_time_ms", 12.5, "ms")])
        run.save(harness.long_rows("grpo_step_fwd_bwd", impl, "G=2", metrics))
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == harness.FIELDS
        got = {(r["impl"], r["metric"]): r["value"] for r in reader if (r["git_sha"], r["device"]) == meta[1:]}
    assert got == {("padded", "oom"): "0", ("padded", "step_time_ms"): "12.5", ("packed", "oom"): "1"}
    assert run.finish() and plots and plots[0].stat().st_size > 0 and out.with_suffix(".md").exists()
    # --resume: what this sha measured on this device is skipped; another sha's or device's is not
    assert run.skip("grpo_step_fwd_bwd", "padded", "G=2") and run.skip("grpo_step_fwd_bwd", "packed", "G=2")
    assert not run.skip("grpo_step_fwd_bwd", "padded", "G=4")
    assert not harness.Results(out, ("torch=2", "def", "cpu (test)"), resume=True).skip("grpo_step_fwd_bwd", "padded",
                                                                                        "G=2")
    killed = harness.Results(out, meta)
    killed.save(harness.long_rows("grpo_step_fwd_bwd", "padded", "G=8", harness.failure_metrics(
        {"killed_by_signal": 9, "host_available_gib": 1.0, "host_available_min_gib": 0.5})))
    with pytest.raises(SystemExit, match="killed"):
        killed.finish()
    assert any(r["shape"] == "G=8" and r["metric"] == "killed_by_signal" for r in csv.DictReader(out.open()))


def test_every_script_imports_only_benchmark_modules_that_exist():
    """A script importing a module of benchmarks/ that a refactor removed (campaign/results_io.py became harness.py)
    fails only when someone runs it; here, without running it: each `from X import` / `import X` of a module that
    lives under benchmarks/ (or used to) must name a file there."""
    import ast
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    local = {p.stem for p in bench.glob("*.py")} | {"campaign"}
    for script in sorted(bench.rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                parts = name.split(".")
                if parts[0] in local:
                    path = bench.joinpath(*parts)
                    assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), (script, name)
