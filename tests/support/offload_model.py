"""The tiny Llama of the offload tests (test_offload*.py, test_memory_offload.py) and offload's real copy path forced
on CPU (FORCED)."""

import torch
import transformers

from grpo_accel.offload import OffloadConfig

FORCED = OffloadConfig(device_copies=True, use_streams=False, pin_memory=False, min_bytes=0)
B, T, H, V = 2, 16, 32, 128
LAYER_BYTES = B * T * H * 4  # one decoder layer's input, fp32


def tiny_llama(layers=4, dropout=0.0, seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).train()
