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

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from campaign.results_io import ROOT, read_train_run, run_meta, write_results  # noqa: E402

from grpo_accel.generation.continuous_batching import ROUND_PAGE_SIZE  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "rollout_budget.csv"


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


def train(impl: str, seed: int, args, out: Path) -> tuple[list[dict], dict, float]:
    done = out / "bench_wall_s"
    if done.exists():  # --runs-dir: a run a killed or earlier invocation finished is read, not made again
        print(f"[train] {impl}, seed {seed}: read from {out}", flush=True)
        return read_train_run(out) + (float(done.read_text()),)
    cmd = command(impl, seed, args, out)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: the {impl} run (seed {seed}) failed:\n{proc.stderr[-3000:]}")
    print(f"[train] {impl}, seed {seed}: {args.steps} steps in {wall:.0f} s (whole process)", flush=True)
    done.write_text(f"{wall:.3f}")
    return read_train_run(out) + (wall,)


def _f(row: dict, key: str, default: float = float("nan")) -> float:
    value = row.get(key)
    return float(value) if value not in (None, "") else default


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    want = [r for r in rows if r["metric"] in ("step_s_mean", "generation_s_mean")]
    impls = list(dict.fromkeys(r["impl"] for r in want))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, metric in enumerate(("step_s_mean", "generation_s_mean")):
        vals = [statistics.mean([float(r["value"]) for r in want if r["impl"] == impl and r["metric"] == metric]
                                or [0.0]) for impl in impls]
        ax.bar([x + 0.4 * i for x in range(len(impls))], vals, 0.4, label=metric.replace("_mean", ""))
    ax.set_xticks([x + 0.2 for x in range(len(impls))], impls, rotation=12, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step (mean over the run and seeds)")
    ax.set_title("route continuous_batching, long-tailed completions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=96)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (4 completions each)")
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
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
            got, summary, wall = train(impl, seed, args, tmp / f"{impl}-seed{seed}")
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
    write_results(rows, args.out, run_meta("cpu", packages=("torch", "transformers", "trl")), plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
