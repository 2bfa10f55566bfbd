"""A step that does not wait for its longest completion (issue 53, item 5): the same LoRA run on route
continuous_batching with `--rollout_budget` off and on, on a task whose completion lengths have a long tail, beside
TRL's own way to decode more per generation (`--steps_per_generation 2`: one generation batch for two optimizer
steps, the second trained one policy version later under TRL's clipped ratio); and on route colocated vLLM
(`vllm_*`, in the vLLM venv: make setup-vllm), off and on.

    .venv/bin/python benchmarks/bench_rollout_budget.py --steps 8 --seeds 0 1 2      # nothing else running

The embedded SmolLM2-135M-Instruct in fp32, LoRA r 16, the arithmetic demo task with a completion limit (96) well
above the length of the completions that end (the demo's first steps: 13-15 tokens, while a quarter to a half run to
the limit), 2 prompts x 4 completions per step. Each run is launch/train.py as a user starts it. Per run: seconds per
step over the whole run (the training loop's time / steps: a budget's steps alternate between decoding two batches'
rounds and handing over groups already complete, so a median would mislead), generation seconds per step,
completion lengths, decode rounds, the fraction of decode slots that produced a token (`rollouts/slot_use`; without a
budget: mean length / longest length of the step's batch, the same measure for one round), completions carried,
groups dropped past max_staleness, and the held-out accuracy after the run (`--eval_size`, greedy). Writes
benchmarks/results/rollout_budget.csv (long format) and rollout_budget.png.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import ROOT

from grpo_accel.generation.continuous_batching import ROUND_PAGE_SIZE

# budget_off_page16: today's route with the pages of 16 tokens a budgeted step's pool has (rollout_budget.py
# ROUND_PAGE_SIZE), so the budget's figure is not credited with what the page size alone gives
IMPLS = {"budget_off": [],
         "budget_off_page16": ["--transformers_continuous_batching_config", json.dumps({"page_size": ROUND_PAGE_SIZE})],
         "trl_steps_per_generation_2": ["--steps_per_generation", "2"], "budget_16": ["--rollout_budget", "16"],
         # route colocated vLLM (vllm_shared: the engine shares the trainer's base weights), in the vLLM venv
         "vllm_budget_off": [], "vllm_budget_16": ["--rollout_budget", "16"]}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # make setup-vllm


def route(impl: str) -> list[str]:
    return ["--use_vllm", "true"] if impl.startswith("vllm_") else ["--use_transformers_continuous_batching", "true"]


def command(impl: str, seed: int, args, out: Path) -> list[str]:
    python = str(VLLM_PYTHON) if impl.startswith("vllm_") else sys.executable
    return [python, str(ROOT / "launch" / "train.py"), "--model_dtype", "float32", "--train_size", "256",
           "--eval_size", str(args.eval_size), "--eval_max_new_tokens", str(args.completion_length),
           "--max_completion_length", str(args.completion_length),
           "--num_generations", "4", "--per_device_train_batch_size", str(4 * args.prompts),
           "--max_steps", str(args.steps), "--save_steps", "1000", "--logging_steps", "1", "--seed", str(seed),
           *route(impl), *IMPLS[impl],
           "--output_dir", str(out), "--report_to", "none"]


def _f(row: dict, key: str, default: float = float("nan")) -> float:
    value = row.get(key)
    return float(value) if value not in (None, "") else default


def plot(rows: list[dict], png: Path) -> None:
    harness.grouped_bars(rows, png, [(("step_s_mean", "generation_s_mean"), "seconds per step (mean over the run and "
                                      "seeds)")], group=lambda r: r["impl"], series=lambda r: r["metric"][:-5],
                         title="route continuous_batching, long-tailed completions", fmt="%.2f")


def parse_args(argv=None):
    p = harness.parser(__doc__, "rollout_budget.csv")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=96)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (4 completions each)")
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="where the runs go (default: a new temporary folder); runs finished there are read, not redone")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(i.startswith("vllm_") for i in args.impls) and not VLLM_PYTHON.exists():
        raise SystemExit(f"error: the vllm_* runs need the vLLM venv ({VLLM_PYTHON}). Fix: make setup-vllm, or "
                         "--impls without them")
    tmp = args.runs_dir or Path(tempfile.mkdtemp(prefix="bench_rollout_budget_"))
    print(f"runs in {tmp}", flush=True)
    rows = []
    for seed in args.seeds:
        for impl in args.impls:  # alternating, so a change of the machine's speed touches every impl alike
            got, summary, wall = harness.train_run(command(impl, seed, args, tmp / f"{impl}-seed{seed}"),
                                                   tmp / f"{impl}-seed{seed}", f"{impl}, seed {seed}",
                                                   dict(OMP_NUM_THREADS=str(args.threads)))
            step = summary["train_seconds"] / len(got)
            # a step that generated nothing (TRL's second step of a generation batch) logs no generation figures
            gen = statistics.mean(_f(r, "time/generation_s", 0.0) for r in got)
            generated = [r for r in got if _f(r, "completions/max_length") == _f(r, "completions/max_length")]
            if "rollouts/rounds" in got[0]:
                slot_use = statistics.mean(_f(r, "rollouts/slot_use") for r in got if _f(r, "rollouts/rounds") > 0)
            else:  # one round at the limit: the batch's tokens over its slots (longest length x completions)
                slot_use = statistics.mean(_f(r, "completions/mean_length") / _f(r, "completions/max_length")
                                           for r in generated)
            shape = (f"smollm2-135m,fp32,lora-r16,G=4,prompts={args.prompts},C={args.completion_length},"
                     f"route={'vllm_shared' if impl.startswith('vllm_') else 'continuous_batching'},"
                     f"steps={args.steps},seed={seed}")
            metrics = [("step_s_mean", step, "s"), ("generation_s_mean", gen, "s"),
                       ("step_s_median", statistics.median(_f(r, "step_time") for r in got), "s"),
                       ("steps_per_hour", 3600 / step, "steps/h"), ("slot_use", slot_use, "fraction"),
                       ("mean_length", statistics.mean(_f(r, "completions/mean_length") for r in generated), "tokens"),
                       ("clipped_ratio", statistics.mean(_f(r, "completions/clipped_ratio") for r in generated),
                        "fraction"),
                       ("run_wall_s", wall, "s")]
            # memory: on CPU the telemetry's peaks are host RSS (allocated = reserved there); on CUDA its phases' peaks
            for key in ("memory/generation_peak_gib", "memory/backward_peak_gib", "memory/host_rss_gib"):
                seen = [_f(r, key) for r in got if r.get(key)]
                if seen:
                    metrics.append((key.split("/")[1].replace("_gib", "") + "_max", max(seen), "GiB"))
            if "rollouts/rounds" in got[0]:
                metrics += [("decode_rounds", sum(_f(r, "rollouts/rounds", 0) for r in got), "rounds"),
                            ("carried_completions", sum(_f(r, "rollouts/carried_completions", 0) for r in got),
                             "completions"),
                            ("prefill_tokens_again", sum(_f(r, "rollouts/prefill_tokens_again", 0) for r in got),
                             "tokens"),
                            ("dropped_groups", _f(got[-1], "rollouts/dropped_groups_total", 0), "groups")]
            for when in ("before", "after"):
                if "accuracy_lenient" in summary.get(when, {}):
                    metrics.append((f"heldout_accuracy_lenient_{when}", summary[when]["accuracy_lenient"], "fraction"))
                    metrics.append((f"heldout_accuracy_strict_{when}", summary[when]["accuracy_strict"], "fraction"))
            rows += [dict(op="rollout_budget_steps", impl=impl, shape=shape, metric=m, value=f"{v:.4g}", unit=u)
                     for m, v, u in metrics]
            after = summary.get("after", {})
            print(f"{impl} seed {seed}: {step:.2f} s/step (generation {gen:.2f} s), slot use {slot_use:.2f}, "
                  f"held-out accuracy {after.get('accuracy_lenient', float('nan')):.3f}", flush=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch's import here: the device column names the runs'
    harness.write_results(rows, args.out, harness.run_meta("cpu", ("torch", "transformers", "trl")), plot)
    return 0


if __name__ == "__main__":
    harness.run(main)
