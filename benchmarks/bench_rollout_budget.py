"""A step that does not wait for its longest completion (issue 53, item 5): the same LoRA run on route
continuous_batching with `--rollout_budget` off and on, on a task whose completion lengths have a long tail.

    .venv/bin/python benchmarks/bench_rollout_budget.py --steps 8 --seeds 0 1      # nothing else running

The embedded SmolLM2-135M-Instruct in fp32, LoRA r 16, the arithmetic demo task with a completion limit well above
its median (the demo's first steps: completions that end do so after 13-15 tokens, half run to the limit), 2 prompts
x 4 completions per step. Each run is launch/train.py as a user starts it (one thread). Per run: wall time per step
(the median after the first two: the budget's first step has only its own groups in flight), generation time per
step, completion lengths, decode rounds, the fraction of decode slots that produced a token (`rollouts/slot_use`;
budget off: mean length / longest length of the step's batch, the same measure for one round), completions carried,
groups dropped past max_staleness, and the held-out accuracy after the run (`--eval_size`, greedy). Writes
benchmarks/results/rollout_budget.csv (long format) and rollout_budget.png.

Not yet measured: its first run (2026-11-28, --steps 8 --completion-length 96, 2 threads) had not finished the
budget-off run after ~25 min (the held-out evaluation before training done, no step logged) and was stopped; find
where the time goes (one step's phases: `time/generation_s`) at smaller sizes before quoting a figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from campaign.results_io import ROOT, run_meta, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "rollout_budget.csv"


def train(budget: int, seed: int, args, out: Path) -> tuple[list[dict], dict, float]:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--model_dtype", "float32", "--train_size", "256",
           "--eval_size", str(args.eval_size), "--eval_max_new_tokens", str(args.completion_length),
           "--max_completion_length", str(args.completion_length),
           "--num_generations", "4", "--per_device_train_batch_size", str(4 * args.prompts),
           "--max_steps", str(args.steps), "--save_steps", "1000", "--logging_steps", "1", "--seed", str(seed),
           "--use_transformers_continuous_batching", "true", "--rollout_budget", str(budget),
           "--output_dir", str(out), "--report_to", "none"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: the budget-{budget} run (seed {seed}) failed:\n{proc.stderr[-3000:]}")
    print(f"[train] budget {budget}, seed {seed}: {args.steps} steps in {wall:.0f} s (whole process)", flush=True)
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    summary = json.loads((out / "summary.json").read_text())
    return rows, summary, wall


def _f(row: dict, key: str, default: float = float("nan")) -> float:
    value = row.get(key)
    return float(value) if value not in (None, "") else default


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    want = [r for r in rows if r["metric"] in ("step_s_median", "generation_s_median")]
    impls = list(dict.fromkeys(r["impl"] for r in want))
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, metric in enumerate(("step_s_median", "generation_s_median")):
        vals = [statistics.mean([float(r["value"]) for r in want if r["impl"] == impl and r["metric"] == metric]
                                or [0.0]) for impl in impls]
        ax.bar([x + 0.4 * i for x in range(len(impls))], vals, 0.4, label=metric.replace("_median", ""))
    ax.set_xticks([x + 0.2 for x in range(len(impls))], impls)
    ax.set_ylabel("seconds per step (median, mean over seeds)")
    ax.set_title("route continuous_batching, long-tailed completions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=96)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (4 completions each)")
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout_budget_"))
    rows = []
    for seed in args.seeds:
        for budget in args.budgets:
            got, summary, wall = train(budget, seed, args, tmp / f"budget{budget}-seed{seed}")
            later = got[2:]
            step = statistics.median(_f(r, "step_time") for r in later)
            gen = statistics.median(_f(r, "time/generation_s") for r in later)
            if budget:
                slot_use = statistics.mean(_f(r, "rollouts/slot_use") for r in later)
            else:  # one round at the limit: the batch's tokens over its slots (longest length x completions)
                slot_use = statistics.mean(_f(r, "completions/mean_length") / _f(r, "completions/max_length")
                                           for r in later)
            impl = f"budget_{budget}" if budget else "budget_off"
            shape = (f"smollm2-135m,fp32,lora-r16,G=4,prompts={args.prompts},C={args.completion_length},"
                     f"steps={args.steps},seed={seed}")
            metrics = [("step_s_median", step, "s"), ("generation_s_median", gen, "s"),
                       ("steps_per_hour", 3600 / step, "steps/h"), ("slot_use", slot_use, "fraction"),
                       ("mean_length", statistics.mean(_f(r, "completions/mean_length") for r in got), "tokens"),
                       ("clipped_ratio", statistics.mean(_f(r, "completions/clipped_ratio") for r in got), "fraction"),
                       ("run_wall_s", wall, "s")]
            if budget:
                metrics += [("carried_completions", sum(_f(r, "rollouts/carried_completions", 0) for r in got),
                             "completions"),
                            ("dropped_groups", _f(got[-1], "rollouts/dropped_groups_total", 0), "groups")]
            after = summary.get("after", {})
            if "accuracy_lenient" in after:
                metrics.append(("heldout_accuracy_lenient", after["accuracy_lenient"], "fraction"))
            rows += [dict(op="rollout_budget_steps", impl=impl, shape=shape, metric=m, value=f"{v:.4g}", unit=u)
                     for m, v, u in metrics]
            print(f"{impl} seed {seed}: step {step:.2f} s median (generation {gen:.2f} s), slot use {slot_use:.2f}, "
                  f"held-out accuracy {after.get('accuracy_lenient', float('nan')):.3f}", flush=True)
    write_results(rows, args.out, run_meta(f"cpu ({args.threads} threads)", packages=("torch", "transformers", "trl")),
                  plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
