"""What every benchmark shares: the long-format CSV (merge by key, keep other devices' rows) and run metadata."""

from __future__ import annotations

import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/campaign/ is two below
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


def merge_csv(rows: list[dict], path: Path, key=("op", "impl", "shape", "device")) -> list[dict]:
    """Replace the rows of `path` that share `key` with the new ones; keep everything else (e.g. GPU rows
    measured elsewhere when re-running on CPU). Returns the file's rows."""
    fresh = {tuple(r[k] for k in key) for r in rows}
    old = []
    if path.exists():
        with path.open() as f:
            old = [r for r in csv.DictReader(f) if tuple(r[k] for k in key) not in fresh]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(old + rows)
    return old + rows


def write_results(rows: list[dict], path: Path, meta: tuple[str, str, str], plot=None,
                  key=("op", "impl", "shape", "device")) -> list[dict]:
    """Every benchmark's tail: stamp `rows` with run_meta's (versions, git sha, device) and today's date, merge them
    into `path`, redraw the PNG beside it with `plot(all_rows, png_path)` and its card (benchmarks/cards.py), and say
    where. Returns the file's rows."""
    versions, sha, dev = meta
    today = datetime.date.today().isoformat()
    for r in rows:
        r.update(device=dev, versions=versions, git_sha=sha, date=today)
    all_rows = merge_csv(rows, path, key)
    if plot is not None:
        plot(all_rows, path.with_suffix(".png"))
    from cards import card  # benchmarks/cards.py (benchmarks/ is on sys.path): the CSV's card beside it

    path.with_suffix(".md").write_text(card(path))
    print(f"wrote {path}, its card" + (f" and {path.with_suffix('.png')}" if plot is not None else ""), flush=True)
    return all_rows


def read_train_run(out: Path) -> tuple[list[dict], dict]:
    """A finished launch/train.py run's output folder: its logged training steps (metrics.csv rows with a loss) and
    summary.json (held-out accuracy before and after, train_seconds)."""
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return rows, json.loads((out / "summary.json").read_text())


def cpu_model() -> str:
    """The CPU's name, family/model and torch's kernel level: CI's 2-core machines differ 2-3x run to run (an AVX2-only
    EPYC, an AVX-512 Zen 5 EPYC, a Xeon), so a CPU figure names the machine it was read on."""
    import torch

    info: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        pass
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        name += f" family {info['cpu family']} model {info.get('model', '?')}"
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


def run_meta(device: str, packages=("torch", "trl")) -> tuple[str, str, str]:
    """(versions, git sha, device description) for the CSV's columns."""
    import importlib

    import torch

    versions = []
    for name in packages:
        try:
            versions.append(f"{name}={importlib.import_module(name).__version__}")
        except ImportError:
            pass
    # GRPO_ACCEL_GIT_SHA: for copies of the tree without .git (a GPU machine that receives the files only)
    sha = os.environ.get("GRPO_ACCEL_GIT_SHA")
    if not sha:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    if device == "cuda":
        dev = torch.cuda.get_device_name()
    else:
        dev = f"cpu ({cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return " ".join(versions), sha or "unknown", dev


# ------------------------------------------------------------------------------------------ a bench's worker process
GIB = 1 << 30


def host_available_gib() -> float | None:
    """MemAvailable of this host (GiB), None where /proc/meminfo cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def run_worker_process(cmd: list[str], env: dict, cwd, timeout_s: float | None = None, poll_s: float = 1.0) -> dict:
    """Run one variant's worker; {returncode, stdout, stderr, timed_out, signal, host_available_gib (when it ended),
    host_available_min_gib (lowest seen while it ran, every `poll_s`)}. A worker the kernel kills (the OOM killer's
    signal 9) leaves no message of its own: the signal and the host's free memory are what say why."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    t0, lowest, out, err = time.monotonic(), host_available_gib(), "", ""
    while True:
        try:
            out, err = proc.communicate(timeout=poll_s)  # retried after a timeout, no output is lost
            break
        except subprocess.TimeoutExpired:
            now = host_available_gib()
            lowest = now if lowest is None or (now is not None and now < lowest) else lowest
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                proc.kill()
                out, err = proc.communicate()
                return dict(returncode=proc.returncode, stdout=out, stderr=err, timed_out=True, signal=None,
                            host_available_gib=host_available_gib(), host_available_min_gib=lowest)
    code = proc.returncode
    return dict(returncode=code, stdout=out, stderr=err, timed_out=False, signal=-code if code < 0 else None,
                host_available_gib=host_available_gib(), host_available_min_gib=lowest)


def killed_result(impl: str, run: dict) -> dict:
    """A variant's result when its worker died by a signal: what the CSV and the summary say instead of figures."""
    gib = run["host_available_gib"]
    low = run["host_available_min_gib"]
    print(f"{impl}: killed by signal {run['signal']}; host memory available then {_gib(gib)} GiB (lowest while it "
          f"ran {_gib(low)} GiB)", flush=True)
    return {"impl": impl, "oom": False, "killed_by_signal": run["signal"], "host_available_gib": gib,
            "host_available_min_gib": low}


RESULT_TAG = "RESULT "  # a worker's one result line: RESULT_TAG + json


def worker_result(run: dict, impl: str, T: int, oom_texts=("OutOfMemoryError", "CUDA out of memory")) -> dict:
    """A step worker's result from run_worker_process's record: its last RESULT_TAG line; else timed out, killed by
    a signal, or out of memory outside the step (one of `oom_texts` in its stderr); anything else is a failure of
    our own, raised with the worker's stderr."""
    lines = [ln for ln in run["stdout"].splitlines() if ln.startswith(RESULT_TAG)]
    if lines:
        return json.loads(lines[-1][len(RESULT_TAG):])
    if run["timed_out"]:
        return {"impl": impl, "oom": False, "timed_out": True}
    if run["signal"]:  # no message of its own (the OOM killer's 9): the signal and the host's memory say why
        return killed_result(impl, run)
    if any(text in run["stderr"] for text in oom_texts):
        return {"impl": impl, "oom": True, "error": "out of memory outside the step"}
    print(run["stderr"][-3000:], file=sys.stderr)
    raise SystemExit(f"{impl} T={T} failed (rc {run['returncode']})")


def killed_rows(res: dict) -> list[tuple[str, float, str]]:
    """(metric, value, unit) of a killed variant, for the long-format CSV."""
    rows = [("killed_by_signal", float(res["killed_by_signal"]), "signal")]
    for key in ("host_available_gib", "host_available_min_gib"):
        if res.get(key) is not None:
            rows.append((key, round(res[key], 2), "GiB"))
    return rows


def _gib(x):
    return "?" if x is None else f"{x:.1f}"


def already_measured(path: Path, meta: tuple[str, str, str], op: str, impl: str, shape: str,
                     metric: str = "oom") -> bool:
    """A bench's --resume: `impl` has figures at `shape` in `path` from this sha and device (`metric` is written
    for every variant that ended, out of memory or not; a killed or timed-out one has none), so a retried row runs
    only the variants that failed."""
    _, sha, dev = meta
    if not path.exists():
        return False
    with path.open() as f:
        return any((r["op"], r["impl"], r["shape"], r["metric"], r["git_sha"], r["device"])
                   == (op, impl, shape, metric, sha, dev) for r in csv.DictReader(f))
