"""Log-prob head, forward + backward: naive vs TRL 1.16's chunked function vs ours (chunked, Triton on CUDA).

    OMP_NUM_THREADS=1 python benchmarks/bench_logprobs.py --quick      # CPU: goal shape only, fp32, 2 rounds
    python benchmarks/bench_logprobs.py                                  # CUDA: the full grid, bf16

Every (impl, shape, round) runs in a fresh subprocess, so one impl's allocator state cannot flatter another's.
Peak extra memory = peak minus the memory held after the inputs exist (includes the grads every impl returns):
  CUDA  torch.cuda.max_memory_allocated() - memory_allocated() before the call
  CPU   peak resident set size (VmHWM, reset through /proc/self/clear_refs) - RSS before the call; this counts
        what the allocator really touched, which is what runs a CPU host out of memory.
Each worker first runs the impl once (warm-up, see `worker`), then measures one call.
Time = median over rounds of one forward + backward; rounds visit the impls in rotating order so that load from
other processes on a shared host falls on all of them alike. The workload is GRPO's: log-probs and entropy
(for logging) of every token, loss on the log-probs only, hidden and weight both trainable, temperature 1.
Writes benchmarks/results/logprobs.csv (long format; rows for the same impl/shape/device are replaced) and
benchmarks/results/logprobs.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from campaign.results_io import merge_csv, run_meta  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GOAL = (16384, 576, 49152)


def _rss_kib(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise RuntimeError(key)


def worker(impl, n, h, v, dtype_name, device):
    """One forward + backward of `impl`; prints a JSON line with time and peak extra memory."""
    import torch

    sys.path.insert(0, str(ROOT))
    from grpo_accel.ops.logprobs import chunked_logprobs

    if impl == "trl":  # imported only where used: TRL's import alone takes seconds per worker
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
    if impl == "triton":
        from grpo_accel.ops.logprobs_triton import triton_logprobs
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device).manual_seed(0)
    hidden = (torch.randn(n, h, device=device, generator=g) / h**0.25).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) / h**0.25).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    grad_logp = torch.randn(n, device=device, generator=g)

    def naive(hidden, weight, targets):
        logp_all = (hidden @ weight.T).float().log_softmax(-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    # as GRPOTrainer's add_fused_lm_head calls it (all labels valid here, so no compaction)
    def trl(hidden, weight, targets):
        logp, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0,
                                                         _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                                         ("log_probs", "entropy"))
        return logp, entropy

    fns = {
        "naive": naive,
        "trl": trl,
        "chunked": lambda h, w, t: chunked_logprobs(h, w, t, compute_entropy=True),
        "triton": lambda h, w, t: triton_logprobs(h, w, t, compute_entropy=True),
    }
    cuda = device == "cuda"
    # warm-up: library/kernel loading, Triton compilation, allocator set-up are paid once per training run, not
    # per step (on CPU they add 30-130 MiB of RSS to a first call); same shape on CUDA, 256 rows on CPU (cheap)
    n_warm = n if cuda else min(n, 256)
    logp, _ = fns[impl](hidden[:n_warm], weight, targets[:n_warm])
    (logp * grad_logp[:n_warm]).sum().backward()
    hidden.grad = weight.grad = logp = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        base = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    try:
        logp, entropy = fns[impl](hidden, weight, targets)
        (logp * grad_logp).sum().backward()
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        print(json.dumps({"oom": True}))
        return
    ms = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024) - base
    print(json.dumps({"time_ms": ms, "peak_extra_mib": peak / 2**20, "load_1min": os.getloadavg()[0]}))


def _meta(device):
    return run_meta(device, ("torch", "trl", "triton"))


def run_grid(args):
    shapes = [(n, h, v) for n in args.n for h in args.h for v in args.v]
    versions, sha, dev = _meta(args.device)
    date = datetime.date.today().isoformat()
    rows = []
    for n, h, v in shapes:
        shape = f"N={n},H={h},V={v},{args.dtype}"
        got = {impl: [] for impl in args.impls}
        for r in range(args.reps):
            order = args.impls[r % len(args.impls):] + args.impls[: r % len(args.impls)]
            for impl in order:
                cmd = [sys.executable, __file__, "--worker", impl, str(n), str(h), str(v), args.dtype, args.device]
                out = subprocess.run(cmd, capture_output=True, text=True)
                line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
                if out.returncode != 0 or not line.startswith("{"):
                    print(out.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"{impl} {shape} failed (rc {out.returncode})")
                got[impl].append(json.loads(line))
                print(f"{shape} round {r} {impl}: {line}", flush=True)
        for impl, res in got.items():
            ok = [x for x in res if not x.get("oom")]
            metrics = [("oom", float(len(ok) < len(res)), "bool")]
            if ok:
                metrics += [
                    ("fwd_bwd_time_ms", statistics.median(x["time_ms"] for x in ok), "ms"),
                    ("peak_extra_mem_mib", max(x["peak_extra_mib"] for x in ok), "MiB"),
                    ("rounds", float(len(ok)), "count"),
                ]
                if "load_1min" in ok[0]:
                    metrics.append(("host_load_1min", statistics.mean(x["load_1min"] for x in ok), "procs"))
            for metric, value, unit in metrics:
                rows.append(dict(op="logprobs_fwd_bwd", impl=impl, shape=shape, metric=metric, value=f"{value:.6g}",
                                 unit=unit, device=dev, versions=versions, git_sha=sha, date=date))
    return rows


def write_csv(rows, path):
    return merge_csv(rows, path, key=("impl", "shape", "device"))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["device"], r["shape"]) for r in rows})
    impls = [i for i in ("naive", "trl", "chunked", "triton") if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(groups) + 4), 4.5))
    for ax, metric, label in zip(axes, ("fwd_bwd_time_ms", "peak_extra_mem_mib"),
                                 ("forward + backward time (ms)", "peak extra memory (MiB, log)")):
        for k, impl in enumerate(impls):
            vals = []
            for g in groups:
                hit = [float(r["value"]) for r in rows
                       if (r["device"], r["shape"]) == g and r["impl"] == impl and r["metric"] == metric]
                vals.append(hit[0] if hit else 0.0)
            ax.bar([i + 0.8 * k / len(impls) for i in range(len(groups))], vals, 0.8 / len(impls), label=impl)
        ax.set_xticks([i + 0.4 - 0.4 / len(impls) for i in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{d[:24]}" for d, s in groups], fontsize=7)
        ax.set_title(label)
        if metric == "peak_extra_mem_mib":
            ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=6, metavar=("IMPL", "N", "H", "V", "DTYPE", "DEVICE"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="CPU preset: the goal shape (N=16384, H=576, V=49152) only")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--h", type=int, nargs="+", default=[576, 4096])
    p.add_argument("--v", type=int, nargs="+", default=[49152, 128256, 151936])
    p.add_argument("--impls", nargs="+", default=None, help="default: naive trl chunked (+ triton on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="rounds; time is the median (default 3, 2 with --quick)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", type=Path, default=RESULTS / "logprobs.csv")
    args = p.parse_args()
    if args.worker:
        impl, n, h, v, dtype, device = args.worker
        return worker(impl, int(n), int(h), int(v), dtype, device)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # the Triton interpreter on CPU is a correctness tool, not a speed measure
    args.impls = args.impls or ["naive", "trl", "chunked"] + (["triton"] if args.device == "cuda" else [])
    if args.quick:
        args.n, args.h, args.v = [GOAL[0]], [GOAL[1]], [GOAL[2]]
    args.reps = args.reps or (2 if args.quick else 3)
    rows = write_csv(run_grid(args), args.out)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
