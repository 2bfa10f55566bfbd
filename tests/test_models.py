import time

import pytest
import torch

from grpo_accel.data.models import DEFAULT_MODEL, ModelNotFoundError, embedded_model_dir, load_model, resolve_model_path


def test_embedded_default_is_the_real_instruct_model():
    embedded_model_dir()  # converted once per cache (make test does this before pytest)
    t0 = time.time()
    model, tokenizer = load_model(DEFAULT_MODEL)
    assert time.time() - t0 < 30  # later loads read the safetensors copy, not the GGUF
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.chat_template and len(tokenizer) == 49152
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=30, do_sample=False)
    assert "12" in tokenizer.decode(out[0, enc["input_ids"].shape[1]:])


@pytest.mark.parametrize("name,model_type", [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_tiny_models_share_the_tokenizer(name, model_type):
    model, tokenizer = load_model(name)
    assert model.config.model_type == model_type and model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 8_000_000
    a, _ = load_model(name)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), a.parameters()))  # seeded init


def test_unknown_model_names_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="could not be loaded from the hub.*Fix"):
        resolve_model_path("no-such-org/no-such-model-xyz")
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_path(str(tmp_path))


def test_a_bitsandbytes_checkpoint_without_quantization_names_the_flag(tmp_path):
    """A run with --quantization none does not import bitsandbytes (app/bitsandbytes_gate.py), so a checkpoint saved
    4-bit must say which flag loads it, not fail inside transformers."""
    import json
    import os

    from grpo_accel.data.models import ModelLoadError

    src = embedded_model_dir()
    for name in os.listdir(src):
        os.symlink(src / name, tmp_path / name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="bitsandbytes-quantized weights. Fix: --quantization 4bit"):
        load_model(str(tmp_path))
