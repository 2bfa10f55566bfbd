"""Random checkpoints of real shapes and a tokenizer built in code: what the GPU benches load, with no download.

Our GPU hosts reach no hub and no registry (../shared/gpu/README.md). Memory and speed depend on shapes, not trained
values, so every GPU row loads random weights of a named architecture (grpo_accel.planning.architectures), saved
once per architecture under one folder and reused by every row that needs a checkpoint (the 4-bit rows of
bench_step_memory.py and the preset runs of gpu_presets.py: a Qwen3-8B checkpoint is 16 GB of disk and ~30 s).

The tokenizer: byte-level (every UTF-8 byte one token, ids 0-255) with ChatML's special tokens and template, as
the embedded SmolLM2 model's. A prompt is then ~3-4x more tokens than with SmolLM2's 49K-word BPE (the CSVs record
the measured prompt length); every id is below any real model's vocabulary.

    PYTHONPATH=benchmarks python -c "import campaign.random_models as r; print(
        r.offline_tokenizer().apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,
                                                  add_generation_prompt=True))"
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # SmolLM2's names; bos 256, eos 257, pad 258
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def offline_tokenizer():
    """A byte-level BPE without merges (exact round trip of any text), ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIALS))
    fast.chat_template = CHATML
    return fast


def _byte_of(ch: str) -> int:
    """GPT-2's byte-to-unicode table, inverted: printable bytes map to themselves, the rest to 256 + k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(ch) - 256]


def save_random_model(architecture: str, target: Path, dtype: str = "bfloat16") -> Path:
    """Random weights of a named architecture + the offline tokenizer under target/<architecture>, once: a second
    call (any row, any script) returns the saved folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_accel.planning.architectures import get_architecture

    path = Path(target) / architecture
    if (path / "config.json").exists():
        return path
    tokenizer = offline_tokenizer()
    config = get_architecture(architecture)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # no 32 GB fp32 detour on the host
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    partial = path.with_suffix(".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, path)  # a killed save never leaves a half model that looks complete
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path
