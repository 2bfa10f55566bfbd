"""How long the command line takes to answer: whole-process wall time, median of --reps fresh processes.

    .venv/bin/python benchmarks/bench_cli_startup.py            # nothing else running on the machine
    .venv/bin/python benchmarks/bench_cli_startup.py --reps 5 --ref HEAD~3   # also time another commit (a worktree)

Commands (issue 51's goals on 2 cores): `launch/train.py --help` <= 3 s, `grpo-accel presets` <= 2 s,
`grpo-accel plan --preset h100_110k` <= 5 s, and `python -c pass` as the interpreter's floor. Each run is a new
process with a warm page cache (one untimed run first), as a user's second call is. With --ref the same commands run
in a git worktree of that commit, through the same interpreter (its venv's packages, the worktree's code), in
alternation with this checkout's, so both see the same machine load. Writes benchmarks/results/cli_startup.csv (long
format) and cli_startup.png.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from campaign.results_io import ROOT, run_meta, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cli_startup.csv"
GOALS_S = {"train_help": 3.0, "presets": 2.0, "plan_h100_110k": 5.0}


def commands(tree: Path) -> dict[str, list[str]]:
    # what the `grpo-accel` console script runs (console_main; main where a --ref commit predates it)
    cli = ["-c", "import sys; from grpo_accel.app import cli; sys.exit(getattr(cli, 'console_main', cli.main)())"]
    return {"python_pass": ["-c", "pass"],
            "train_help": [str(tree / "launch" / "train.py"), "--help"],
            "presets": [*cli, "presets"],
            "plan_h100_110k": [*cli, "plan", "--preset", "h100_110k"]}


def run_once(args: list[str], tree: Path) -> float:
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # plan exits 1 when the plan does not fit: still an answer
        raise SystemExit(f"error: {' '.join(args)} in {tree} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return took


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = [r for r in rows if r["metric"] == "wall_s_median"]
    ops = list(dict.fromkeys(r["op"] for r in med))
    impls = list(dict.fromkeys(r["impl"] for r in med))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        vals = [next((float(r["value"]) for r in med if r["op"] == op and r["impl"] == impl), 0.0) for op in ops]
        ax.bar([x + i * width for x in range(len(ops))], vals, width, label=impl)
    for x, op in enumerate(ops):
        if op in GOALS_S:
            ax.hlines(GOALS_S[op], x - 0.4, x + 0.8, colors="k", linestyles="dashed")
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(ops))], ops)
    ax.set_ylabel("wall time, s (median)")
    ax.set_title("command-line start-up, whole process (dashed: issue 51's goal)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ref", help="also time this commit (a temporary git worktree), e.g. origin/main or a sha")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    trees = {"this": ROOT}
    tmp = None
    if args.ref:
        tmp = tempfile.mkdtemp(prefix="bench_cli_ref_")
        subprocess.run(["git", "worktree", "add", "--detach", tmp, args.ref], cwd=ROOT, check=True,
                       capture_output=True)
        trees[f"ref_{args.ref}"] = Path(tmp)
    try:
        times = {(op, impl): [] for impl in trees for op in commands(ROOT)}
        for tree in trees.values():  # warm the page cache and any bytecode cache
            for cmd in commands(tree).values():
                run_once(cmd, tree)
        for rep in range(args.reps):
            for op in commands(ROOT):
                for impl, tree in trees.items():
                    times[op, impl].append(run_once(commands(tree)[op], tree))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{op}[{impl}] {t[-1]:.2f} s"
                                                             for (op, impl), t in times.items()), flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, capture_output=True)
    rows = []
    for (op, impl), ts in times.items():
        shape = f"reps={len(ts)}"
        rows += [dict(op=op, impl=impl, shape=shape, metric="wall_s_median", value=f"{statistics.median(ts):.3f}",
                      unit="s"),
                 dict(op=op, impl=impl, shape=shape, metric="wall_s_min", value=f"{min(ts):.3f}", unit="s"),
                 dict(op=op, impl=impl, shape=shape, metric="wall_s_max", value=f"{max(ts):.3f}", unit="s")]
        goal = GOALS_S.get(op)
        print(f"{op:16s} {impl:12s} median {statistics.median(ts):6.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})"
              + (f"  goal <= {goal:.0f} s: {'met' if statistics.median(ts) <= goal else 'NOT met'}"
                 if goal and impl == "this" else ""))
    write_results(rows, args.out, run_meta("cpu", packages=("torch", "transformers", "trl")), plot=plot,
                  key=("op", "impl", "shape", "device"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
