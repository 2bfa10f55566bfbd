"""benchmarks/campaign/run.py: rows in order, each in its own process group with its own limit, the ledger that
resumes a campaign across GPU loans, and the summary.

    OMP_NUM_THREADS=1 pytest tests/test_gpu_campaign.py            # the plumbing with stand-in scripts (seconds)
    OMP_NUM_THREADS=1 pytest tests/test_gpu_campaign.py -m long    # --cpu-check twice: every real script, tiny sizes
"""

import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch import ROOT, child_env

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import campaign.run as gc  # noqa: E402

# Stand-ins for benchmark scripts: one writes a long-format row; one starts a worker and hangs, as a stuck step does.
WRITES = """import sys
import harness
out = sys.argv[sys.argv.index("--out") + 1]
harness.write_results([dict(op="x", impl="a", shape="s,", metric="value", value="1.5", unit="u")],
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


@pytest.fixture(autouse=True)
def no_planner(monkeypatch, request):
    """The stand-in rows test plumbing: the summary's planner (TRL's imports, seconds) is a constant there; the
    planner test below calls it for real."""
    import campaign.summary

    if "replans" not in request.node.name:
        monkeypatch.setattr(campaign.summary, "plan_now_gib", lambda preset, prompt, completion: 1.0)


def ledger(results, sha=None):
    return {(r["impl"], r["metric"]): float(r["value"]) for r in csv.DictReader((results / gc.LEDGER).open())
            if sha is None or r["git_sha"] == sha}


def test_rows_run_in_order_a_hang_is_killed_and_a_rerun_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "benchmarks"))  # the stand-ins import harness
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
                                      equal_lengths=False,
                                      preset=dict(zip(row.args, row.args[1:])).get("--preset"))
            assert bench_step_memory._shape(args, s["completion_length"]).startswith(row.shape_prefix(False))


@pytest.mark.long  # one --cpu-check: 2 min 53 s on 2 busy cores (issue 35): make test-distributed
def test_cpu_check_twice_runs_every_script_then_skips_every_row(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "campaign", "run.py"), "--cpu-check", "--results",
           str(results)]
    # an offline host; the vLLM rows' CPU check is the vLLM tier's (tests/vllm_engine/test_engine_rows.py)
    # one sha for both runs: the ledger is keyed by it, and a commit made while the first ran (its ~6 min) made the
    # second run every row again and time out
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    env = dict(child_env(), PIP_NO_INDEX="1", GRPO_ACCEL_CACHE=str(tmp_path / "no_cache"),
               VLLM_PYTHON=str(tmp_path / "no_vllm_python"), GRPO_ACCEL_GIT_SHA=sha.strip() or "unknown")
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    rows, _ = gc.campaign_rows(True, None)
    present = [r.name for r in rows if r.script_path().exists() and not r.vllm]
    assert [r.name for r in rows if r.vllm] and "skipped, no vLLM interpreter" in first.stdout
    got = ledger(results)
    assert all(got[(name, "exit_code")] == 0 for name in present), got  # every real script, its GPU flags
    page = (results / gc.SUMMARY).read_text()
    for row in rows:
        assert f"| {row.name} |" in page
    for name in present:  # each judge found its row's figures in its CSV at this sha
        line = next(ln for ln in page.splitlines() if f"| {name} |" in ln)
        assert "| done in" in line and line.endswith("| cpu check: no goal |"), line
    for png in ("step_memory.png", "packing.png", "presets_gpu.png", "continuous_batching.png"):
        assert (results / png).stat().st_size > 0
    step_csv_holds_every_variants_figures_and_equal_losses(results)
    presets_csv_holds_the_launched_runs_telemetry(results, tmp_path / "models")
    cb_csv_holds_both_routes_and_resume_skips_them(results, tmp_path, env, rows)

    assert not (tmp_path / "no_cache").exists()  # nothing on the GPU path fetched the embedded model
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    skipped = [ln for ln in again.stdout.splitlines() if ": skipped, in the ledger" in ln]
    assert len(skipped) == len(present) and ledger(results) == got
    assert (results / gc.SUMMARY).read_text() == page  # nothing ran, nothing changed


# The benchmark scripts' own checks, on the CSVs the rows above wrote: each script's CPU run was made twice, once by
# its own test and once by the campaign's row with the same flags (issue 51: ~80 s of CI for one defect).
def step_csv_holds_every_variants_figures_and_equal_losses(results):
    """benchmarks/bench_step_memory.py (row step_32k, with ours_head_offload on CPU): padded completions of unequal
    length; accumulating one row at a time (ours_mb1, TRL's trl_tuned with transformers' offload) gives the loss and
    the gradient of the whole batch (ours_head_offload)."""
    with (results / "step_memory.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["op", "impl", "shape", "metric", "value", "unit", "device", "versions",
                                     "git_sha", "date"]
        rows = [r for r in reader if r["shape"] == "tiny-llama,lora-r16,G=2,P=4,T=8,fp32,padded"]
    impls = ["ours_head_offload", "ours_mb1", "trl_tuned"]
    got = {i: {r["metric"]: float(r["value"]) for r in rows if r["impl"] == i} for i in impls}
    assert {r["op"] for r in rows} == {"grpo_step_fwd_bwd"} and rows[0]["device"].startswith("cpu")
    for impl, m in got.items():
        assert m["oom"] == 0 and m["checkpointing"] == 1 and m["host_is_device"] == 1, impl
        assert m["step_time_ms"] > 0 and m["peak_step_mem_mib"] > 0 and math.isfinite(m["loss"]), impl
        # rows of 4 + 4 and 4 + 8 real tokens
        assert m["time_per_token_us"] == pytest.approx(m["step_time_ms"] * 1e3 / 20, rel=1e-3), impl
        assert m["peak_step_mem_with_weights_mib"] > m["peak_step_mem_mib"], impl
    assert got["ours_head_offload"]["offloaded_peak_mib"] > 0, "forced copies on CPU: the stash held host bytes"
    for impl in ("ours_mb1", "trl_tuned"):
        assert got[impl]["loss"] == pytest.approx(got["ours_head_offload"]["loss"], rel=1e-4), impl
        assert got[impl]["lora_grad_norm"] == pytest.approx(got["ours_head_offload"]["lora_grad_norm"], rel=1e-4)
    assert (results / "step_memory.png").stat().st_size > 0


def presets_csv_holds_the_launched_runs_telemetry(results, models):
    """benchmarks/gpu_presets.py (row preset_cpu): a random model saved, the preset launched through `accelerate
    launch`, the run's telemetry and the planner's prediction in the long-format CSV."""
    got = {r["metric"]: r for r in csv.DictReader((results / "presets_gpu.csv").open()) if r["impl"] == "cpu"}
    assert got["completed"]["value"] == "1.0" and got["completion_length_run"]["value"] == "8"
    assert float(got["peak_allocated_gib"]["value"]) > 0.1  # the launched run's own telemetry (host RSS on CPU)
    assert float(got["predicted_reserved_gib"]["value"]) > 0 and "T=" in got["completed"]["shape"]
    assert (models / "tiny-llama" / "config.json").exists()


def cb_csv_holds_both_routes_and_resume_skips_them(results, tmp_path, env, rows):
    """benchmarks/bench_continuous_batching.py (row cb_generation): both routes' figures reach the CSV, and the
    script's own --resume (the row's command run once more) measures nothing twice. Memory is checked for presence
    only: at these sizes paged's peak is above generate()'s (whole 256-token pages of 45 KiB/token for 2 x 16 tokens,
    ~60 MiB against ~1 MiB of cache), so the comparison the benchmark exists for needs its real sizes."""
    out = results / "continuous_batching.csv"
    written = list(csv.DictReader(out.open()))
    got = {(r["impl"], r["metric"]): float(r["value"]) for r in written}
    assert {r["op"] for r in written} == {"cb_generation"} and len({r["shape"] for r in written}) == 1
    for impl in ("paged", "generate"):
        assert got[(impl, "decode_tok_s_8")] > 0
        assert got[(impl, "tokens_8")] == 2 * 8  # G x C: EOS stayed off on both routes
        assert got[(impl, "peak_gib_8")] >= 0 and got[(impl, "plan_gib_8")] > 0
    assert got[("paged", "plan_pool_gib_8")] > 0 and all(r["git_sha"] and r["device"] for r in written)
    row = next(r for r in rows if r.name == "cb_generation")
    cmd = gc.command(row, True, results, tmp_path / "logs", tmp_path / "models", resume=True)
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert again.stdout.count("(--resume)") == 2 and len(list(csv.DictReader(out.open()))) == len(written)


# ------------------------------------------------------------------------------------- issue 35: what a loan needs
def test_list_marks_the_headline_rows_with_limits_that_cover_their_estimates_and_fit_one_call(capsys):
    assert gc.main(["--list"]) == 0
    out = capsys.readouterr().out
    rows, _ = gc.campaign_rows(False, gc.assumed_h100())
    head = [r for r in rows if r.headline]
    # the six less the h100_110k preset (a GPU point before the campaign; past its limit on the first loan)
    assert [r.name for r in head] == ["step_32k", "seeds_20k", "long_t_64k", "packing", "shared_prompt"]
    # issue 43: the engine's rows come first in a loan (the engine has never run on a GPU), the headline rows next
    # and issue 44: Unsloth's a and b (paired with seeds_20k and step_32k), then its longest completion; issue 45:
    # route continuous_batching against generate(), then the h100_110k preset's command on it (no vLLM)
    lead = [r.name for r in rows[:10]]
    assert lead == ["engine_shared", "engine_4bit", "engine_decode_8k", "preset_h100_110k+engine",
                    "engine_prefill_h100_110k", "unsloth_20k", "unsloth_32k", "unsloth_max_t", "cb_generation",
                    "preset_h100_110k+cb"], lead
    assert [r.name for r in rows if r.vllm] == lead[:5]
    assert rows[len(lead):len(lead) + len(head)] == head and out.count(" headline ") == len(head)
    total = sum(r.limit_s for r in head)
    assert f"headline total: {total} s" in out and total <= gc.HEADLINE_BUDGET_S <= 700  # one 15-minute loan
    for r in head:
        est, how = r.estimate
        assert 0 < est <= r.limit_s and f"limit {r.limit_s:>3d} s (est. {est:.0f} s" in out, r.name
    for r in rows:  # a G=2 row says why G=2 measures what the goal needs
        if r.gpu.get("num_generations") == 2:
            assert "peak does not grow with G" in r.note and "per token" in r.note, r.name


def test_a_killed_worker_is_reported_with_its_signal_and_the_hosts_free_memory():
    from harness import host_available_gib, killed_result, killed_rows, run_worker_process

    run = run_worker_process([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                             dict(os.environ), ROOT, poll_s=0.05)
    assert run["signal"] == 15 and not run["timed_out"]  # the signal sent, not an exit code
    res = killed_result("packed", run)
    metrics = dict((m, v) for m, v, _ in killed_rows(res))
    assert metrics["killed_by_signal"] == 15
    assert 0 < metrics["host_available_gib"] <= 1.5 * host_available_gib()  # /proc/meminfo's, in GiB
    t0 = time.monotonic()
    hung = run_worker_process([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), ROOT,
                              timeout_s=0.5, poll_s=0.1)
    assert hung["timed_out"] and hung["signal"] is None and time.monotonic() - t0 < 20  # a bench's own timeout


def test_each_variant_reaches_the_csv_as_it_ends_so_a_killed_bench_keeps_it(tmp_path, monkeypatch):
    """bench_shared_prompt's first variant ends, the second's worker is killed by a signal, then the bench itself is
    killed (as the campaign kills a row at its limit): the CSV holds the first's figures and the second's signal."""
    import bench_shared_prompt as bench
    from harness import killed_result

    out = tmp_path / "shared_prompt.csv"
    killed = dict(returncode=-9, signal=9, host_available_gib=3.5, host_available_min_gib=0.25)
    answers = iter([dict(oom=False, time_ms=[10.0], cpu_ms=[9.0], peak_mib=5.0, loss=1.0, grad_norm=2.0,
                         layer_tokens=40, load_1min=0.1), killed_result("packed", killed)])

    def worker(args, impl, P, C, G):
        if impl == "trl_padded":
            raise KeyboardInterrupt  # the bench killed mid-way
        return next(answers)

    monkeypatch.setenv("GRPO_ACCEL_GIT_SHA", "abc")
    monkeypatch.setattr(bench, "run_worker", worker)
    argv = ["bench", "--prompt-lengths", "8", "--completion-lengths", "4", "--generations-grid", "2", "--device",
            "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    got = {(r["impl"], r["metric"]): r["value"] for r in csv.DictReader(out.open())}
    assert float(got[("shared", "step_time_ms")]) == 10.0 and float(got[("shared", "peak_step_mem_mib")]) == 5.0
    assert float(got[("packed", "killed_by_signal")]) == 9 and float(got[("packed", "host_available_min_gib")]) == 0.25
    assert not any(impl == "trl_padded" for impl, _ in got)

    ran = []  # the campaign's retry (--resume): only the killed and the missing variants run again
    monkeypatch.setattr(bench, "run_worker", lambda args, impl, P, C, G: ran.append(impl) or dict(
        oom=True, error="stand-in"))
    monkeypatch.setattr(sys, "argv", argv + ["--resume"])
    bench.main()
    assert ran == ["packed", "trl_padded"]
    monkeypatch.setenv("GRPO_ACCEL_GIT_SHA", "def")  # another sha: nothing measured there yet
    ran.clear()
    bench.main()
    assert ran == ["shared", "packed", "trl_padded"]


def test_a_bench_row_resumes_its_variants_unless_redone(tmp_path):
    """Every try skips what this sha measured (a retry runs only what failed; seeds_20k skips what unsloth_20k's
    --with-ours measured in its call); --redo NAME measures again."""
    rows, _ = gc.campaign_rows(False, gc.assumed_h100())
    for row in rows:
        redo, again = (gc.command(row, False, tmp_path, tmp_path, tmp_path, resume=r) for r in (False, True))
        assert "--resume" not in redo, row.name
        assert ("--resume" in again) == (row.script != "gpu_presets.py"), row.name  # a preset run is one variant
    # the Unsloth rows measure ours and tuned TRL at their own shapes first: the headline rows' shapes
    by = {r.name: r for r in rows}
    for name, pair in (("unsloth_20k", "seeds_20k"), ("unsloth_32k", "step_32k")):
        assert "--with-ours" in by[name].args and by[name].shape_prefix(False) == by[pair].shape_prefix(False)


def test_a_killed_row_is_failed_with_its_signal_in_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "benchmarks"))
    script = tmp_path / "dies.py"
    script.write_text("import os, signal\nprint('dying', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\n")
    row = gc.Row("dies", "m", "g", 999, str(script), "dies.csv", "x", judge, cpu_limit_s=20)
    results = tmp_path / "results"
    [entry] = gc.run_campaign([row], [], META, results, tmp_path / "logs", tmp_path / "models")
    assert ledger(results)[("dies", "exit_code")] == -15
    assert entry["state"].startswith("failed (killed by signal 15, host memory available then ")
    assert "dying" in (results / gc.SUMMARY).read_text()


def test_preflight_names_what_to_bring_when_an_import_fails(tmp_path, monkeypatch, capsys):
    import campaign.preflight as pre

    real = pre.check_import
    monkeypatch.setattr(pre, "check_import", lambda name: (False, "ModuleNotFoundError: No module named 'pydantic'")
                        if name == "pydantic" else real(name))
    rows, _ = gc.campaign_rows(False, gc.assumed_h100())
    t0 = time.monotonic()
    chosen = [r for r in rows if r.headline or r.name == "preset_h100_110k"]  # the preset row needs deepspeed
    assert pre.preflight(chosen, tmp_path) == 1
    assert time.monotonic() - t0 < 60  # seconds, not a row's minutes
    out = capsys.readouterr().out
    assert "MISSING pydantic" in out and "1 row(s): preset_h100_110k" in out
    assert out.strip().splitlines()[-1].startswith("error: the rows cannot run here. Fix: bring pydantic")
    for name in ("deepspeed", "bitsandbytes", "triton", "trl", "datasets"):  # every import the issue names
        assert f" {name} " in out, name


def test_the_offline_tokenizer_round_trips_bytes_and_renders_chatml(tmp_path):
    from campaign.random_models import offline_tokenizer
    from transformers import AutoTokenizer

    tok = offline_tokenizer()
    text = "What is 12 + 7? naïve ✓\n  x"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text  # one token per UTF-8 byte
    assert ids[:4] == list(b"What")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)  # what a preset run loads from the checkpoint folder
    assert again(text)["input_ids"] == ids and again.eos_token == "<|im_end|>" and again.pad_token_id is not None


def test_the_planner_error_starts_with_the_first_gpu_point_and_replans_with_this_checkout(tmp_path, monkeypatch):
    import campaign.summary as summary

    calls = []
    monkeypatch.setattr(summary, "plan_now_gib", lambda p, prompt, c: calls.append((p, prompt, c)) or 7.0)
    (tmp_path / "presets_gpu.csv").write_text(
        "op,impl,shape,metric,value,unit,device,versions,git_sha,date\n"
        + "".join(f"preset_2_steps,h100_110k,qwen3-8b T=150+128 G=8,{m},{v},u,NVIDIA H100,v,abc,2026-12-01\n"
                  for m, v in (("completed", 1), ("completion_length_run", 128), ("peak_reserved_gib", 8.0),
                               ("predicted_reserved_gib", 9.0))))
    first, second = summary.planner_vs_presets(tmp_path)
    assert (first["preset"], first["tokens"], first["then"], first["reserved"]) == ("h100_110k", "42 + 128", "15.10",
                                                                                     "6.44")
    assert first["error_then"] == "+134.5%" and first["error_now"] == f"{7.0 / 6.44 - 1:+.1%}"  # issue 34's +134%
    assert second["where"] == "NVIDIA H100 @ abc" and second["error_then"] == "+12.5%" and second["now"] == "7.00"
    assert calls == [("h100_110k", 42, 128), ("h100_110k", 150, 128)]  # re-planned at each point's own lengths


def test_an_engine_row_judges_only_its_own_variants_and_prompt_length(tmp_path):
    """The engine rows share engine.csv and the shape prefix "{arch},": the H200 loan of 2026-11-28 measured only
    engine_shared's `shared` variant, and the summary showed its figures and verdict ("missed") under the pending
    engine_4bit and engine_decode_8k too."""
    import harness
    from campaign import summary
    from campaign.rows import engine_rows

    rows = {r.name: r for r in engine_rows(cpu=False)}
    shape = "qwen3-8b,bfloat16,lora-r16,G=8,P=128,kv=8.0GiB"
    with open(tmp_path / "engine.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=harness.FIELDS)
        w.writeheader()
        for metric, value in (("weights_shared", 1.0), ("engine_cost_gib", 8.4), ("kv_cache_gib", 8.0),
                              ("logprob_gap_max", 0.2), ("decode_tok_s_1024", 1095.0)):
            w.writerow(dict(op="engine", impl="shared", shape=shape, metric=metric, value=value, unit="x",
                            device="GPU", versions="v", git_sha="abc", date="2026-11-28"))
    judged = {name: summary.judge_engine(summary.RowView(rows[name], False, tmp_path, "abc", "GPU", {}))
              for name in ("engine_shared", "engine_4bit", "engine_decode_8k")}
    assert "weights shared 1.00" in judged["engine_shared"][0]
    assert judged["engine_4bit"] == ("", "") and judged["engine_decode_8k"] == ("", "")
