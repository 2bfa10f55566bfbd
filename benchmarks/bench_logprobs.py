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

import os
import statistics
import time

import harness  # benchmarks/ is on sys.path when run as a script

GOAL = (16384, 576, 49152)
IMPLS = ("naive", "trl", "chunked", "triton")


def worker(impl, n, h, v, dtype_name, device) -> dict:
    """One forward + backward of `impl`: its time and peak extra memory."""
    import torch

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
    try:
        with harness.Peak(cuda) as peak:  # CUDA: allocated above the inputs; CPU: VmHWM above the RSS before
            t0 = time.perf_counter()
            logp, entropy = fns[impl](hidden, weight, targets)
            (logp * grad_logp).sum().backward()
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
    except torch.OutOfMemoryError:
        return {"oom": True}
    return {"time_ms": ms, "peak_extra_mib": peak.figures["peak"] / 2**20, "load_1min": os.getloadavg()[0]}


def run_grid(args):
    shapes = [(n, h, v) for n in args.n for h in args.h for v in args.v]
    rows = []
    for n, h, v in shapes:
        shape = f"N={n},H={h},V={v},{args.dtype}"
        got = {impl: [] for impl in args.impls}
        for r in range(args.reps):
            order = args.impls[r % len(args.impls):] + args.impls[: r % len(args.impls)]
            for impl in order:
                flags = harness.cli_flags(dict(n=n, h=h, v=v, dtype=args.dtype, device=args.device))
                got[impl].append(harness.run_worker(__file__, flags, impl, cwd=None, label=shape))
                print(f"{shape} round {r} {impl}: {got[impl][-1]}", flush=True)
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
            rows += harness.long_rows("logprobs_fwd_bwd", impl, shape, metrics)
    return rows


def plot(rows, path):
    harness.grouped_bars(rows, path, [("fwd_bwd_time_ms", "forward + backward time (ms)"),
                                      ("peak_extra_mem_mib", "peak extra memory (MiB, log)")],
                         group=lambda r: (r["device"], r["shape"]), series=lambda r: r["impl"], sort=True, fmt=None,
                         order=[i for i in IMPLS if any(r["impl"] == i for r in rows)],
                         tick=lambda g: f"{g[1]}\n{g[0][:24]}", log=("peak_extra_mem_mib",))


def main(argv=None):
    p = harness.parser(__doc__, "logprobs.csv", worker=IMPLS, device=True)
    p.add_argument("--quick", action="store_true", help="CPU preset: the goal shape (N=16384, H=576, V=49152) only")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--h", type=int, nargs="+", default=[576, 4096])
    p.add_argument("--v", type=int, nargs="+", default=[49152, 128256, 151936])
    p.add_argument("--impls", nargs="+", default=None, help="default: naive trl chunked (+ triton on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="rounds; time is the median (default 3, 2 with --quick)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    args = harness.parse(p, argv, lambda a: worker(a.worker, a.n[0], a.h[0], a.v[0], a.dtype, a.device))
    args.device = harness.pick_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # the Triton interpreter on CPU is a correctness tool, not a speed measure
    args.impls = args.impls or ["naive", "trl", "chunked"] + (["triton"] if args.device == "cuda" else [])
    if args.quick:
        args.n, args.h, args.v = [GOAL[0]], [GOAL[1]], [GOAL[2]]
    args.reps = args.reps or (2 if args.quick else 3)
    harness.write_results(run_grid(args), args.out, harness.run_meta(args.device, ("torch", "trl", "triton")), plot)


if __name__ == "__main__":
    harness.run(main)
