"""Dynamic sampling (issue 66, item 5): plain GRPO against `--dynamic_sampling` on the demo task with the correctness
reward only, the same route and steps, several seeds; each run is launch/train.py as a user starts it.

    .venv/bin/python benchmarks/bench_dynamic_sampling.py --steps 16 --seeds 0 1      # nothing else running
    .venv/bin/python benchmarks/bench_dynamic_sampling.py --steps 12 --plain-steps 20 --seeds 0 1 2   # equal time

The embedded SmolLM2-135M-Instruct in fp32, LoRA r 16 (the `cpu` preset: 2 prompts x 8 completions per step, at most
40 new tokens, temperature 0.7, lr 2e-4), `--rewards correctness` (no format reward: a group is flat whenever its 8
answers are all right or all wrong), `--max_sampling_rounds 3`. Per run: held-out accuracy (strict and lenient,
greedy, `--eval_size` problems whose number pairs never occur in training) before and after, the training loop's
seconds, and per step the fraction of flat groups among those sampled (`frac_reward_zero_std`), the groups the
batch kept and the refill rounds. Accuracy per wall-clock second is the comparison: a dynamic-sampling step costs
more generation and teaches from more groups. Writes benchmarks/results/dynamic_sampling.csv and .png.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import ROOT

OP = "grpo_run"
IMPLS = {"plain": [], "dynamic_sampling": ["--dynamic_sampling", "true", "--max_sampling_rounds", "3"]}


def steps_of(impl: str, args) -> int:
    return args.plain_steps if impl == "plain" and args.plain_steps else args.steps


def command(impl: str, seed: int, args, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "launch" / "train.py"), "--preset", "cpu", "--rewards", "correctness",
            "--eval_size", str(args.eval_size), "--max_steps", str(steps_of(impl, args)), "--save_steps", "1000",
            "--seed", str(seed), "--output_dir", str(out), "--report_to", "none", *IMPLS[impl]]


def rows_of(impl: str, seed: int, steps: list[dict], summary: dict, wall: float, args) -> list[dict]:
    def mean(key: str) -> float:
        values = [float(r[key]) for r in steps if r.get(key) not in (None, "")]
        return statistics.fmean(values) if values else float("nan")

    after, before = summary["after"], summary["before"]
    metrics = [("accuracy_strict_after", after["accuracy_strict"], "fraction"),
               ("accuracy_lenient_after", after["accuracy_lenient"], "fraction"),
               ("accuracy_strict_before", before["accuracy_strict"], "fraction"),
               ("accuracy_lenient_before", before["accuracy_lenient"], "fraction"),
               ("train_s", float(summary["train_seconds"]), "s"), ("process_wall_s", wall, "s"),
               ("frac_flat_groups_sampled", mean("frac_reward_zero_std"), "fraction"),
               ("rounds_per_step", mean("dynamic_sampling/rounds") if impl != "plain" else 1.0, "rounds"),
               ("groups_kept_per_step", mean("dynamic_sampling/groups_kept"), "groups"),
               # lenient: the correctness reward pays a right number whatever the format, strict needs `Answer: N`
               ("accuracy_gain_per_train_min", (after["accuracy_lenient"] - before["accuracy_lenient"])
                / (float(summary["train_seconds"]) / 60), "fraction/min")]
    metrics = [m for m in metrics if m[1] == m[1]]  # a figure plain GRPO does not log (NaN) is left out
    # one shape for both arms of a comparison: dynamic sampling's steps, and plain GRPO's where it got more of them
    # (--plain-steps: the same wall-clock budget); each arm's own count is its `steps` figure
    plain = f",plain_steps={args.plain_steps}" if args.plain_steps else ""
    shape = f"smollm2-135m,lora-r16,G=8,C=40,correctness,steps={args.steps}{plain},seed={seed}"
    metrics.append(("steps", float(steps_of(impl, args)), "steps"))
    return harness.long_rows(OP, impl, shape, metrics)


def plot(rows: list[dict], path: Path) -> None:
    panels = [("accuracy_lenient_after", "held-out accuracy after (lenient)"), ("train_s", "training seconds"),
              ("accuracy_gain_per_train_min", "accuracy gained per training minute"),
              ("frac_flat_groups_sampled", "flat groups among those sampled")]
    harness.grouped_bars(rows, path, panels, group=lambda r: r["shape"].split(",seed=")[0].split(",")[-1],
                         series=lambda r: r["impl"], order=list(IMPLS),
                         title="plain GRPO vs dynamic sampling, mean over seeds (demo task, correctness reward)")


def main(argv=None) -> None:
    p = harness.parser(__doc__, "dynamic_sampling.csv", device=True, resume=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--plain-steps", type=int, default=None,
                   help="plain GRPO's steps (default --steps): more of them give it dynamic sampling's wall-clock "
                        "budget (a dynamic-sampling step samples more groups; train_s says what each arm took)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--runs-dir", default=None, help="keep the runs here (a rerun reads the finished ones)")
    args = harness.parse(p, argv)
    run = harness.Results.of(args, ("torch", "trl", "transformers"), plot)
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="bench_ds_"))
    for seed in args.seeds:  # the arms interleaved: a machine's load drifts over both alike
        for impl in IMPLS:
            out = runs / f"{impl}-seed{seed}"
            steps, summary, wall = harness.train_run(command(impl, seed, args, out), out, f"{impl} seed {seed}")
            run.save(rows_of(impl, seed, steps, summary, wall, args))
    run.finish()


if __name__ == "__main__":
    harness.run(main)
