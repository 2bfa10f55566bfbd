"""Route continuous_batching (transformers' `generate_batch`, a planned page pool) against HF generate() on the same
model, prompt and adapter: decode tokens/s and the generation's peak memory, beside the plan's terms (issue 45, 5).

    python benchmarks/bench_continuous_batching.py                      # CPU: SmolLM2-135M fp32, C = 64 256 1024
    python benchmarks/bench_continuous_batching.py --arch qwen3-8b --dtype bfloat16 --completion-lengths 1024 8192
    .venv-vllm-0.26/bin/python benchmarks/bench_continuous_batching.py --variants vllm_shared   # the engine tier
    python benchmarks/bench_continuous_batching.py --cpu-check --out /tmp/cb.csv                  # tiny, the campaign's

G sequences = one prompt of P random byte ids x G, side by side as TRL's sampler lays a group (so generate_paged
prefills it once and forks; generate() gets G equal rows, which need no padding). LoRA r16 on every linear layer
with random B, active, as in a GRPO step. Sampling at temperature 1 with EOS disabled, so every sequence runs to C
tokens: generate() by min_new_tokens = C; generate_batch has no min_new_tokens (its logits processors drop it), so
its generation config's eos_token_id is -1 (transformers' "disabled"). Tokens/s count the tokens actually returned.
Each (variant, C) runs in its own process: a warm-up of 4 tokens, then one timed generation of G x C tokens.
  paged        grpo_accel.generation.continuous_batching.generate_paged, the pool from paged_config (the plan) for
               --paged-seqs full-length sequences at once (default: all G; fewer wait in transformers' queue)
  generate     model.generate() on the same model: TRL's path without vLLM (the whole batch's cache at once)
  vllm_shared  grpo_accel.generation.vllm_colocate.SharedVLLM, the trainer's engine (only where vLLM imports)
Figures (op cb_generation; one metric per C, the campaign's judge reads them by name):
  decode_tok_s_C   tokens returned / wall of the timed generation (its prefill and, for paged, the pool's setup in)
  tokens_C         tokens returned (G x C when EOS stayed off)
  peak_gib_C       the generation's peak above the state before it: CUDA max_memory_allocated - allocated before;
                   CPU the process's peak RSS (VmHWM, reset before) - RSS before
  peak_reserved_gib_C  CUDA: max_memory_reserved - reserved before (after empty_cache)
  plan_gib_C       the planner's terms for the route (planning.generation.generation_terms): paged pool + working
                   set; generate() KV cache + working set; for paged also plan_pool_gib_C. vllm_shared: kv_cache_gib
                   (allocated at engine start, so not in its generation peak)
Writes benchmarks/results/continuous_batching.csv (long format) and .png.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from bench_engine import EMBEDDED, hf_model, lora, sync
from campaign.random_models import save_random_model
from harness import GIB, Peak

OP = "cb_generation"
VARIANTS = ("paged", "generate", "vllm_shared")


def plan_terms(model, variant: str, G: int, P: int, C: int, paged_seqs: int | None) -> dict:
    """The planner's generation terms of this route at these sizes (bytes)."""
    import torch

    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.generation import generation_terms

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    a = 2 if dtype in (torch.bfloat16, torch.float16) else dtype.itemsize
    route = "continuous_batching" if variant == "paged" else "generate"
    t = generation_terms(model_shape(model.config), a, route, G, 0, P, P + C, paged_seqs=paged_seqs, group=G)
    if variant == "paged":
        return {"plan": t["paged_kv_cache"] + t["paged_working_set"], "plan_pool": t["paged_kv_cache"]}
    return {"plan": t["generate_kv_cache"] + t["generate_working_set"]}


def worker(args) -> dict:
    """One variant at one completion length in this process: returns its figures."""
    import torch

    from grpo_accel.core import dtypes

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda" if cuda else "cpu"), dtypes.torch_dtype(args.dtype)
    variant, C, G, P = args.worker, args.completion_length, args.num_generations, args.prompt_length
    prompt = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(0)).tolist()  # byte ids
    prompts = [prompt] * G  # one group, side by side
    out = {"variant": variant, "C": C}
    if variant == "vllm_shared":
        return out | vllm_worker(args, prompts, cuda)
    model = lora(hf_model(args.model_dir, dtype, False, device))
    model.eval()
    if variant == "generate":
        ids = torch.tensor(prompts, device=device)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=None)

        def run(n):
            with torch.no_grad():
                return [row[P:].tolist() for row in model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)]
    else:
        from transformers import GenerationConfig

        from grpo_accel.generation.continuous_batching import generate_paged, paged_config

        cfg, line = paged_config(model, generation_batch=G, prompt_tokens=P, completion_tokens=C,
                                 paged_seqs=args.paged_seqs)
        print(f"[cb] {line}", flush=True)

        def run(n):
            gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=n, eos_token_id=-1,
                                  pad_token_id=0)
            return generate_paged(model, prompts, gc, cfg)
    out |= {k + "_bytes": v for k, v in plan_terms(model, variant, G, P, C, args.paged_seqs).items()}
    run(4)  # warm-up
    with Peak(cuda) as peak:
        t0 = time.perf_counter()
        completions = run(C)
        sync(cuda)
        wall = time.perf_counter() - t0
    tokens = sum(map(len, completions))
    return out | {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                  **{k + "_bytes": v for k, v in peak.figures.items()}}


def vllm_worker(args, prompts, cuda: bool) -> dict:
    """bench_engine's shared variant: the engine loads the checkpoint, the training model is views into it."""
    import torch
    from vllm import SamplingParams

    from grpo_accel.core import dtypes
    from grpo_accel.generation import vllm_colocate as vc

    G, P, C = len(prompts), args.prompt_length, args.completion_length
    cfg = vc.EngineConfig(dtype=dtypes.torch_dtype(args.dtype), max_model_len=P + C + 8, max_num_seqs=max(G, 8),
                          max_lora_rank=16, kv_cache_bytes=int(args.kv_cache_gib * GIB),
                          num_threads=torch.get_num_threads())
    engine = vc.SharedVLLM(args.model_dir, cfg)
    model = lora(engine.build_training_model())
    engine.push_adapter(model)
    engine.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=C, min_tokens=C, ignore_eos=True, temperature=1.0, seed=0)
    with Peak(cuda) as peak:
        t0 = time.perf_counter()
        res = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "kv_cache_bytes": cfg.kv_cache_bytes,
            **{k + "_bytes": v for k, v in peak.figures.items()}}


def shape_of(args) -> str:
    seqs = args.paged_seqs or args.num_generations
    return (f"{args.arch},{args.dtype},lora-r16,G={args.num_generations} (1 prompt x G),P={args.prompt_length},"
            f"paged_seqs={seqs}")


def rows_of(res: dict, args) -> list[dict]:
    """A worker's result as long-format rows (device, versions, sha and date added by the caller)."""
    C, rows = res["C"], []
    add = lambda metric, value, unit: rows.append(dict(op=OP, impl=res.get("variant", res.get("impl")),  # noqa: E731
                                                       shape=shape_of(args), metric=f"{metric}_{C}", value=value,
                                                       unit=unit))
    for key in ("oom", "timed_out", "killed_by_signal"):
        if res.get(key):
            add(key, float(res[key]), "bool" if key != "killed_by_signal" else "signal")
    if "tok_s" in res:
        add("decode_tok_s", round(res["tok_s"], 2), "tokens/s")
        add("tokens", res["tokens"], "tokens")
        add("wall_s", round(res["wall_s"], 2), "s")
    for key in ("peak", "peak_reserved", "plan", "plan_pool", "kv_cache"):
        if f"{key}_bytes" in res:
            add(f"{key}_gib", round(res[f"{key}_bytes"] / GIB, 4), "GiB")
    if "peak_bytes" in res and not getattr(args, "cuda", False):  # how the CPU peak was taken
        add("malloc_mmap_threshold", float(args.cpu_mmap_threshold), "bytes")
    return rows


def done(path: Path, meta, variant: str, C: int, args) -> bool:
    """--resume: figures, an out-of-memory or a timeout (past --timeout-s: a retry would run as long again) of this
    variant and C at this sha, device and shape are in the CSV."""
    if not path.exists():
        return False
    want = {(OP, variant, shape_of(args), f"{m}_{C}", meta[1], meta[2]) for m in ("decode_tok_s", "oom", "timed_out")}
    with path.open() as f:
        return any((r["op"], r["impl"], r["shape"], r["metric"], r["git_sha"], r["device"]) in want
                   for r in csv.DictReader(f))


def run_variant(variant: str, C: int, args, model_dir: Path) -> dict:
    flags = harness.cli_flags(dict(model_dir=model_dir, dtype=args.dtype, num_generations=args.num_generations,
                                   prompt_length=args.prompt_length, completion_length=C,
                                   kv_cache_gib=args.kv_cache_gib, paged_seqs=args.paged_seqs or None))
    # a fixed glibc mmap threshold: the RSS peak follows the live tensors (as in tests/test_continuous_batching.py)
    env = dict(harness.step_env("cuda" if args.cuda else "cpu", mmap_threshold=args.cpu_mmap_threshold),
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    t0 = time.time()
    res = harness.run_worker(__file__, flags, variant, env=env, timeout_s=args.timeout_s, label=f"C={C}") | {"C": C}
    print(f"[cb] {variant} C={C}: {time.time() - t0:.0f} s {res}", flush=True)
    return res


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"paged": "#2a7", "generate": "#47c", "vllm_shared": "#c52"}
    for shape, dev in dict.fromkeys((r["shape"], r["device"]) for r in rows):
        for impl in VARIANTS:
            def series(metric):
                got = sorted((int(r["metric"].rsplit("_", 1)[1]), float(r["value"])) for r in rows
                             if (r["shape"], r["device"], r["impl"]) == (shape, dev, impl)
                             and r["metric"].rsplit("_", 1)[0] == metric)
                return [c for c, _ in got], [v for _, v in got]

            xs, ys = series("decode_tok_s")
            if not xs:
                continue
            label = f"{impl} ({dev.split(' (')[0]})"
            speed.plot(xs, ys, "o-", color=colors[impl], label=label)
            mem.plot(*series("peak_gib"), "o-", color=colors[impl], label=f"{label} measured")
            if impl != "vllm_shared" and series("plan_gib")[0]:
                mem.plot(*series("plan_gib"), "x--", color=colors[impl], label=f"{impl} plan")
    for ax, ylabel in ((speed, "decode tokens/s (G sequences)"), (mem, "generation peak above before (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion tokens C")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(f"continuous batching vs generate(): {rows[0]['shape']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = harness.parser(__doc__, worker=VARIANTS)
    p.add_argument("--arch", default=EMBEDDED, help=f"{EMBEDDED}: the embedded real model; else random weights")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="default: paged generate, and vllm_shared where vLLM imports")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--completion-lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--paged-seqs", type=int, default=None, help="sequences the page pool holds at once (default G)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vllm_shared's KV cache")
    p.add_argument("--models-dir", default="/tmp/grpo_accel_gpu_models")
    p.add_argument("--csv", "--out", type=Path, default=harness.RESULTS / "continuous_batching.csv")
    p.add_argument("--timeout-s", type=int, default=1800, help="per (variant, C) process")
    p.add_argument("--cpu-check", action="store_true", help="tiny sizes: the campaign's plumbing check")
    p.add_argument("--cpu-mmap-threshold", type=int, default=64 << 10,
                   help="CPU: glibc MALLOC_MMAP_THRESHOLD_ for the workers, so the RSS peak follows live tensors "
                        "(0: glibc's dynamic default)")
    p.add_argument("--resume", action="store_true", help="skip (variant, C) already in --csv at this sha and shape")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--completion-length", type=int, help=argparse.SUPPRESS)
    if "--cpu-check" in (sys.argv[1:] if argv is None else argv):  # tiny defaults; flags given still win
        p.set_defaults(num_generations=2, prompt_length=8, completion_lengths=[8, 16], kv_cache_gib=0.0625,
                       models_dir=os.environ.get("GRPO_ACCEL_BENCH_MODELS", "/tmp/grpo_accel_cpu_models"))
    args = harness.parse(p, argv, worker)
    from grpo_accel.generation.vllm_availability import fallback_line

    no_vllm = fallback_line()
    if args.variants is None:
        args.variants = ["paged", "generate"] + ([] if no_vllm else ["vllm_shared"])
    elif "vllm_shared" in args.variants and no_vllm:
        raise SystemExit(f"error: vllm_shared needs vLLM: {no_vllm}")
    import torch

    cuda = args.cuda = torch.cuda.is_available()
    meta = harness.run_meta("cuda" if cuda else "cpu", ("torch", "transformers", "vllm"))
    if args.arch == EMBEDDED:
        from grpo_accel.data.models import embedded_model_dir

        model_dir = embedded_model_dir()
    else:
        model_dir = save_random_model(args.arch, Path(args.models_dir), dtype=args.dtype)
    # keyed by metric (one per C); the plot: this shape on this machine, every C measured so far
    mine = lambda rows, png: plot([r for r in rows if (r["shape"], r["device"]) == (shape_of(args), meta[2])], png)
    run = harness.Results(args.csv, meta, mine, key=("op", "impl", "shape", "device", "metric"))
    for C in args.completion_lengths:
        for variant in args.variants:
            if args.resume and done(args.csv, meta, variant, C, args):
                print(f"[cb] {variant} C={C}: in {args.csv} at this sha (--resume)", flush=True)
                continue
            run.save(rows_of(run_variant(variant, C, args, model_dir), args))
    run.finish()


if __name__ == "__main__":
    harness.run(main)
