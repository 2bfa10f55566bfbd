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

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import ROOT

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
    harness.grouped_bars(rows, png, [("wall_s_median", "command-line start-up, whole process: wall time, s (median; "
                                      "dashed: issue 51's goal)")], group=lambda r: r["op"], series=lambda r: r["impl"],
                         goals=GOALS_S, fmt="%.2f")


def main(argv=None) -> int:
    p = harness.parser(__doc__, "cli_startup.csv")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ref", help="also time this commit (a temporary git worktree), e.g. origin/main or a sha")
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
    harness.write_results(rows, args.out, harness.run_meta("cpu", ("torch", "transformers", "trl")), plot)
    return 0


if __name__ == "__main__":
    harness.run(main)
