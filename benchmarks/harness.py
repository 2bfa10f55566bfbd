"""The benchmark harness: what every script in benchmarks/ shares, so that a script holds only what it measures.

  the CSV      long format (FIELDS), merged by key (other devices' rows kept), stamped with run_meta's versions, git sha
               and device, its PNG and card (cards.py) redrawn beside it: write_results; Results for a run that
               appends each variant as it ends, skips what --resume finds, and fails when a worker was killed
  the parser   parser(): --out (the CSV) and, as asked, --device / --resume / the hidden --worker; parse() runs a
               worker process's variant and exits; run(main) ends the process without the stack's teardown
  workers      each variant in a fresh process (its own allocator state and peak): run_worker re-runs the script with
               `--worker IMPL`, reads its one RESULT line, and turns a kill, a timeout or an out-of-memory into a
               result instead of a crash; failure_metrics gives their CSV rows, step_env a CPU worker's environment
  memory       Peak: the peak above the state at entry (CUDA allocator, else the process's VmHWM)
  train runs   train_run: launch/train.py as a user runs it, or the finished run already in its folder (read_train_run)
  the plot     grouped_bars: one panel per metric, one cluster per group, one bar per series
The `vllm serve` launcher is campaign/serve.py (bench_server_async.py and the vLLM tests use it).

A new benchmark: a docstring whose command lines go on the CSV's card; `worker(args) -> dict`, one variant measured in
its own process; `rows_of(result) -> harness.long_rows(op, impl, shape, [(metric, value, unit), ...])`, with
failure_metrics for one that did not end; and a main of a few lines:

    args = harness.parse(p, argv, worker)               # p = harness.parser(__doc__, "name.csv", worker=VARIANTS)
    run = harness.Results.of(args, ("torch", "trl"), plot)
    for impl in VARIANTS:
        if not run.skip(OP, impl, shape):               # --resume
            run.save(rows_of(harness.run_worker(__file__, flags, impl, env=harness.step_env(args.device)), impl))
    run.finish()

bench_sequence_parallel.py is a whole one. Importing this module puts the checkout first on sys.path: the scripts
measure this tree's grpo_accel.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ is one below
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]
GIB, MIB = 1 << 30, 1 << 20


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


# ------------------------------------------------------------------------------------------------ a variant's process
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


def worker_result(run: dict, impl: str, label="", oom_texts=("OutOfMemoryError", "CUDA out of memory")) -> dict:
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
    raise SystemExit(f"{impl} {label} failed (rc {run['returncode']})")


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


def failure_metrics(res: dict) -> list[tuple[str, float, str]]:
    """(metric, value, unit) of how a variant ended: killed (its signal and the host's memory), else `oom` (0 when
    it ran), with host_budget_refused (the trainer's host budget said no) and timed_out where they apply."""
    metrics = killed_rows(res) if "killed_by_signal" in res else [("oom", float(bool(res.get("oom"))), "bool")]
    if res.get("host_refused"):
        metrics.append(("host_budget_refused", 1.0, "bool"))
    if res.get("timed_out"):
        metrics.append(("timed_out", 1.0, "bool"))
    return metrics


def failed(res: dict) -> bool:
    return bool(res.get("oom") or res.get("timed_out") or "killed_by_signal" in res)


def long_rows(op: str, impl: str, shape: str, metrics, fmt="{:.6g}") -> list[dict]:
    """(metric, value, unit) triples as the CSV's rows (device, versions, sha and date come in write_results)."""
    return [dict(op=op, impl=impl, shape=shape, metric=m, value=fmt.format(v), unit=u) for m, v, u in metrics]


# ----------------------------------------------------------------------------------------- the parser, main, workers
def parser(doc: str, out: str | None = None, *, worker=None, device=False, resume=False) -> argparse.ArgumentParser:
    """A script's parser with the flags every script spells alike: --out (the CSV under benchmarks/results/ by
    default), and as asked --device, --resume and the hidden --worker (`worker`: its choices, () for any)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out:
        p.add_argument("--out", type=Path, default=RESULTS / out, help="the CSV (its PNG and card beside it)")
    if worker is not None:
        p.add_argument("--worker", metavar="IMPL", choices=list(worker) or None, help=argparse.SUPPRESS)
    if device:
        p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    if resume:
        p.add_argument("--resume", action="store_true", help="skip variants --out already has from this sha and "
                       "device (campaign/run.py's retry of a failed row runs only what failed)")
    return p


def parse(p: argparse.ArgumentParser, argv=None, worker=None) -> argparse.Namespace:
    """The script's flags. A `--worker IMPL` process (run_worker's) does not return: it measures its variant with
    `worker(args)`, reports the result (one RESULT line) and exits, so a script's main only ever sees the parent."""
    args = p.parse_args(argv)
    if worker is not None and getattr(args, "worker", None):
        result = worker(args)
        run(lambda: report(result))
    return args


def pick_device(name: str | None = None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def run(main) -> None:
    """A script's last line: exit with main()'s code without the stack's teardown (seconds of a core per process,
    grpo_accel/core/process_exit.py)."""
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())


def report(result: dict) -> None:
    """A worker's answer to its parent: one RESULT line of JSON (the last one counts)."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def cli_flags(values: dict) -> list[str]:
    """{"completion_length": 8, "equal_lengths": True, "preset": None} -> ["--completion-length", "8",
    "--equal-lengths"]: a worker's flags from its point's values (None and False left out)."""
    out = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        out.append(f"--{key.replace('_', '-')}")
        if value is not True:
            out += [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
    return out


def run_worker(script, flags: list, impl: str, *, env: dict | None = None, timeout_s: float | None = None,
               cwd=ROOT, label: str = "", echo: bool = False,
               oom_texts=("OutOfMemoryError", "CUDA out of memory")) -> dict:
    """`script --worker IMPL` with `flags` in a fresh process (its own allocator state and peak); its RESULT line,
    or what a kill, a timeout or an out-of-memory outside the step left (worker_result). `env`: added to ours;
    `echo`: print the worker's own stdout (its progress lines) here too."""
    cmd = [sys.executable, str(script), *map(str, flags), "--worker", impl]
    run = run_worker_process(cmd, dict(os.environ, **(env or {})), cwd, timeout_s)
    if echo:
        print(run["stdout"][-3000:], flush=True)
    return worker_result(run, impl, label, oom_texts)


def step_env(device: str, offload: bool = False, mmap_threshold: int = 128 << 10) -> dict:
    """A CPU worker's environment for a memory figure. glibc raises its mmap threshold (up to 32 MiB) each time a
    large block is freed and then serves those sizes from a heap it rarely returns: with the default, the peak RSS
    of a smollm2-135m step was ~900 MiB of retained, freed memory over a ~130 MiB live working set. A fixed
    threshold returns every block >= it at free(), so the peak RSS follows the live tensors (page faults then cost
    time, in every variant). `offload`: the stash's real copies (GRPO_ACCEL_OFFLOAD_FORCE_COPIES), not the CPU's
    no-op twin."""
    if device != "cpu":
        return {}
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {}
    if offload:
        env["GRPO_ACCEL_OFFLOAD_FORCE_COPIES"] = "1"
    return env


class Results:
    """One run's CSV: `save` appends each variant's rows as it ends (a later kill, or the campaign's limit, loses
    none), `skip` says what --resume finds at this sha and device, `finish` redraws the plot and the card, and fails
    the run (exit 1) when a variant's worker was killed."""

    def __init__(self, out: Path, meta: tuple[str, str, str], plot=None, resume=False,
                 key=("op", "impl", "shape", "device")):
        self.out, self.meta, self.plot, self.resume, self.key, self.rows = Path(out), meta, plot, resume, key, []

    @classmethod
    def of(cls, args, packages, plot=None) -> Results:
        """The run of a script whose parser has --device and --resume: the device resolved (args.device), its meta."""
        args.device = pick_device(args.device)
        return cls(args.out, run_meta(args.device, packages), plot, args.resume)

    def skip(self, op: str, impl: str, shape: str, metric: str = "oom", what: str = "") -> bool:
        if self.resume and already_measured(self.out, self.meta, op, impl, shape, metric):
            print(f"{impl} {what}: measured before at this sha and device (--resume): skipped", flush=True)
            return True
        return False

    def save(self, rows: list[dict]) -> list[dict]:
        write_results(rows, self.out, self.meta, key=self.key)
        self.rows += rows
        return rows

    def finish(self) -> list[dict]:
        """Every row of the CSV (this run's and those kept from others)."""
        all_rows = write_results(self.rows, self.out, self.meta, self.plot, self.key)
        if any(r["metric"] == "killed_by_signal" for r in self.rows):
            raise SystemExit("a variant's worker was killed (killed_by_signal above): its row failed, the others "
                             "are in the CSV")
        return all_rows


class Peak:
    """The peak above the state at entry (bytes in .figures): CUDA allocator stats (peak and peak_reserved), else
    the process's VmHWM, reset at entry, less the RSS then: what the allocator really touched, which is what runs a
    CPU host out of memory."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        import torch

        from grpo_accel.core.phase_memory import reset_peak_rss, rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.alloc, self.reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        else:
            reset_peak_rss()
            self.rss = rss_bytes()
        return self

    def __exit__(self, *exc):
        import torch

        from grpo_accel.core.phase_memory import peak_rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            self.figures = {"peak": torch.cuda.max_memory_allocated() - self.alloc,
                            "peak_reserved": torch.cuda.max_memory_reserved() - self.reserved}
        else:
            self.figures = {"peak": peak_rss_bytes() - self.rss}


# ------------------------------------------------------------------------------------------------ launch/train.py runs
def read_train_run(out: Path) -> tuple[list[dict], dict]:
    """A finished launch/train.py run's output folder: its logged training steps (metrics.csv rows with a loss) and
    summary.json (held-out accuracy before and after, train_seconds)."""
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return rows, json.loads((out / "summary.json").read_text())


def train_run(cmd: list[str], out: Path, label: str, env: dict | None = None) -> tuple[list[dict], dict, float]:
    """A launch/train.py command writing to `out`, offline: (its logged steps, summary.json, the process's wall
    seconds). A run finished there before (a killed or earlier invocation's: --runs-dir) is read, not made again."""
    done = out / "bench_wall_s"
    if done.exists():
        print(f"[train] {label}: read from {out}", flush=True)
        return (*read_train_run(out), float(done.read_text()))
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", **(env or {}))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: the {label} run failed:\n{proc.stderr[-3000:]}")
    print(f"[train] {label}: {wall:.0f} s (whole process)", flush=True)
    done.write_text(f"{wall:.3f}")
    return (*read_train_run(out), wall)


# ------------------------------------------------------------------------------------------------ the plot
def grouped_bars(rows: list[dict], path: Path, panels, group, series, *, order=None, title: str = "", tick=str,
                 log=(), goals: dict | None = None, goal: float | None = None, fmt: str | None = "%.3g",
                 sort: bool = False) -> None:
    """A CSV's plot: one panel per (metric or tuple of metrics, title); in each, a cluster of bars per `group(row)`
    (`tick(group)` under it; first seen, or sorted) and a bar per `series(row)` (in `order`, else first seen), each
    the mean of its rows' values (seeds, repeats). A bar missing where the CSV says oom=1 is marked OOM. `goals`:
    a dashed line over a group's cluster ({group: value}); `goal`: one across every panel; `log`: log-scale metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m if isinstance(m, tuple) else (m,), label) for m, label in panels]
    panels = [(m, label) for m, label in panels if any(r["metric"] in m for r in rows)]
    if not panels:  # every variant out of memory, killed or timed out: nothing to draw (the CSV says so)
        return
    wanted = {m for metrics, _ in panels for m in metrics}
    keyed = [(group(r), series(r), r) for r in rows if r["metric"] in wanted or r["metric"] == "oom"]
    groups = list(dict.fromkeys(g for g, _, r in keyed if r["metric"] in wanted))
    groups = sorted(groups) if sort else groups
    names = order or list(dict.fromkeys(s for _, s, r in keyed if r["metric"] in wanted))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(max(6.0, 2 + len(panels) * len(groups) * (0.25 * len(names) + 0.5)), 4.6))
    for ax, (metrics, label) in zip(axes[0], panels):
        for k, name in enumerate(names):
            xs, vals = [], []
            for i, g in enumerate(groups):
                mine = [r for g2, s2, r in keyed if (g2, s2) == (g, name)]
                hit = [float(r["value"]) for r in mine if r["metric"] in metrics]
                if hit:
                    xs.append(i + k * width)
                    vals.append(statistics.mean(hit))
                elif any(r["metric"] == "oom" and float(r["value"]) for r in mine):
                    ax.text(i + k * width, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=7, color=f"C{k}")
            bars = ax.bar(xs, vals, width, label=name, color=f"C{k}")
            if fmt:
                ax.bar_label(bars, fmt=fmt, fontsize=6)
        for i, g in enumerate(groups):
            if goals and g in goals:
                ax.hlines(goals[g], i - width / 2, i + 0.8 - width / 2, colors="k", linestyles="dashed")
        if goal is not None:
            ax.axhline(goal, color="k", linestyle="dashed")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [tick(g) for g in groups], fontsize=7)
        ax.set_title(label, fontsize=9)
        if any(m in log for m in metrics):
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
