"""Named model architectures as transformers config objects, built in code (no download), and `model_shape`.

The planner (`memory.py`) needs a model's shape, not its weights: layers L, hidden H, intermediate I, heads,
KV heads, head_dim, vocab V, tied embeddings and the parameter count. The named configs below copy the published
`config.json` of each model (shapes, vocab, tie_word_embeddings, rope settings) so `grpo-accel plan` works on a
machine without hub access.

    python -c "from grpo_accel.planning.architectures import model_shape; print(model_shape('qwen3-8b'))"
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_accel.core.errors import ConfigError

__all__ = ["ALIASES", "ARCHITECTURES", "TINY_CONFIGS", "ModelShape",
           "get_architecture", "list_architectures", "model_shape"]

# Tiny random-init models share the embedded model's tokenizer (49152 tokens, ChatML template):
# tests get real tokenization and chat templates at ~0.6 s per GRPO step on CPU.
TINY_CONFIGS = {
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "tiny-qwen3": dict(  # q/k RMSNorm per head: the h100_110k preset's family
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    ),
}

# name -> (transformers config class name, kwargs, the hub checkpoint the shape is taken from)
# Values are the published config.json files of the base checkpoints (Instruct variants share the shapes;
# they differ only in max_position_embeddings for Qwen2.5 and in eos ids).
_SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-3.1-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        ),
        "meta-llama/Llama-3.1-8B",
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        ),
        "meta-llama/Llama-3.2-1B",
    ),
    "qwen3-8b": (
        "Qwen3Config",
        dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, bos_token_id=151643,
            eos_token_id=151645, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        "Qwen/Qwen3-8B",
    ),
    "qwen2.5-1.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False, sliding_window=131072, max_window_layers=21,
            bos_token_id=151643, eos_token_id=151643, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        "Qwen/Qwen2.5-1.5B",
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
            tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
            bos_token_id=151643, eos_token_id=151643, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        "Qwen/Qwen2.5-7B",
    ),
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=100000.0),
        ),
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

# Qwen2.5-7B's shapes with a 1,010,000-token context (rope_theta 1e7): what its config.json changes
_SPECS["qwen2.5-7b-1m"] = ("Qwen2Config", {
    **_SPECS["qwen2.5-7b"][1], "max_position_embeddings": 1010000, "rms_norm_eps": 1e-5, "sliding_window": 32768,
    "eos_token_id": 151645, "rope_parameters": dict(rope_type="default", rope_theta=10000000.0),
}, "Qwen/Qwen2.5-7B-Instruct-1M")

# The tiny random test models (TINY_CONFIGS above, built by grpo_accel.data.models); they get SmolLM2's tokenizer ids.
_SMOLLM2_TOKENS = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
for _name, _spec in TINY_CONFIGS.items():
    _kwargs = {k: v for k, v in _spec.items() if k != "model_type"}
    _SPECS[_name] = ({"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[_spec["model_type"]],
                     {**_kwargs, **_SMOLLM2_TOKENS}, "(random init, TINY_CONFIGS)")

ARCHITECTURES: dict[str, str] = {name: spec[2] for name, spec in _SPECS.items()}  # name -> source checkpoint

# Names that resolve offline to a named shape: hub checkpoints (base and Instruct share shapes) and the embedded
# default's name in grpo_accel.data.models.
ALIASES: dict[str, str] = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b", "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "qwen/qwen3-8b": "qwen3-8b", "qwen/qwen3-8b-base": "qwen3-8b",
    "qwen/qwen2.5-1.5b": "qwen2.5-1.5b", "qwen/qwen2.5-1.5b-instruct": "qwen2.5-1.5b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct-1m": "qwen2.5-7b-1m",
    "huggingfacetb/smollm2-135m": "smollm2-135m", "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
}


def list_architectures() -> list[str]:
    return list(_SPECS)


def get_architecture(name: str):
    """A fresh transformers config object for a named architecture or alias (no download)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in _SPECS:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(_SPECS)}")
    import transformers

    cls_name, kwargs, _ = _SPECS[key]
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return config


@dataclass(frozen=True)
class ModelShape:
    """What the memory planner needs to know about a decoder-only transformer."""

    layers: int  # L
    hidden: int  # H
    intermediate: int  # I (MLP)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # V
    tied: bool  # lm_head shares the embedding matrix
    n_params: int
    name: str = ""
    qk_norm: bool = False  # Qwen3 normalizes q and k per head (one more RMSNorm on [T, heads, head_dim])

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """Weights of q, k, v, o and gate, up, down in one layer (what QLoRA quantizes)."""
        H, I = self.hidden, self.intermediate
        return H * self.q_dim + 2 * H * self.kv_dim + self.q_dim * H + 3 * H * I

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the untied lm_head (kept in the compute dtype under QLoRA)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def lora_params(self, r: int) -> int:
        """LoRA A and B on all seven linear layers of every layer: r * (in + out) each."""
        H, I, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        per_layer = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H)
        return self.layers * r * per_layer


def _count_params(L, H, I, heads, kv_heads, head_dim, V, tied, qkv_bias, o_bias, qk_norm) -> int:
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H  # linears + two RMSNorm weights
    per_layer += (q + 2 * kv) if qkv_bias else 0
    per_layer += H if o_bias else 0
    per_layer += 2 * head_dim if qk_norm else 0
    return L * per_layer + V * H * (1 if tied else 2) + H  # + final norm


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _shape_from_config(cfg, name: str = "") -> ModelShape:
    """Works on a transformers config object or the plain dict of a config.json."""
    text = _get(cfg, "text_config")  # multimodal wrappers keep the language model here
    if text is not None and _get(cfg, "hidden_size") is None:
        cfg = text
    model_type = _get(cfg, "model_type", "") or ""
    H = _get(cfg, "hidden_size")
    if H is None:
        raise ValueError(f"config of {name or model_type!r} has no hidden_size: not a decoder-only LM config")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or H // heads
    L, I, V = _get(cfg, "num_hidden_layers"), _get(cfg, "intermediate_size"), _get(cfg, "vocab_size")
    tied = bool(_get(cfg, "tie_word_embeddings", True))
    qkv_bias = model_type == "qwen2" or bool(_get(cfg, "attention_bias", False))  # Qwen2 hard-codes q/k/v bias
    o_bias = model_type != "qwen2" and bool(_get(cfg, "attention_bias", False))
    qk_norm = model_type.startswith("qwen3")
    n = _count_params(L, H, I, heads, kv_heads, head_dim, V, tied, qkv_bias, o_bias, qk_norm)
    return ModelShape(L, H, I, heads, kv_heads, head_dim, V, tied, n, name or model_type, qk_norm)


def model_shape(model) -> ModelShape:
    """Shape of a named architecture, a transformers config object, a local directory / config.json, or a hub name.

    Hub names go through `AutoConfig.from_pretrained` (only config.json is fetched); offline that fails with an
    error naming the fix.
    """
    if isinstance(model, ModelShape):
        return model
    if not isinstance(model, (str, os.PathLike)):
        return _shape_from_config(model, name=getattr(model, "name_or_path", "") or "")
    name = str(model)
    key = ALIASES.get(name.lower(), name.lower())
    if key in _SPECS:  # from the spec itself: planning needs no transformers import (tested equal to the config's)
        cls_name, kwargs, _ = _SPECS[key]
        return _shape_from_config({"model_type": cls_name[: -len("Config")].lower(), **kwargs}, name=key)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _shape_from_config(json.loads(path.read_text()), name=name)
    if path.exists() or name.startswith((".", "/", "~")):
        raise ConfigError(f"{name!r} has no config.json. Fix: pass a model directory with config.json")
    try:
        from transformers import AutoConfig

        return _shape_from_config(AutoConfig.from_pretrained(name), name=name)
    except Exception as exc:  # offline, gated, typo: all end here
        raise ConfigError(
            f"could not read the config of {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
            f"Fix: pass a named architecture ({', '.join(_SPECS)}), a local directory with config.json, "
            "or a hub name with hub access (unset HF_HUB_OFFLINE, `huggingface-cli login` for gated models)."
        ) from exc
