"""What vLLM keeps of a runtime-loaded adapter (adapter_sync.AdapterSync's `dtype`): its LoRA config's "auto" dtype is
the served model's (vllm/config/lora.py, verify_with_model_config), and its loader casts each adapter tensor to it
(vllm/lora/lora_model.py, from_lora_tensors; the worker calls from_local_checkpoint with lora_config.lora_dtype).
So the bf16 files AdapterSync writes for a bf16 base hold exactly what vLLM keeps of PEFT's fp32 ones: loaded by vLLM's
own loader at bfloat16, the two folders give bit-equal tensors. No engine: the loader alone, in a second or two."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from support.vllm_standin import serve  # noqa: E402

from grpo_accel.generation.adapter_sync import AdapterSync, base_dtype  # noqa: E402

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_vllm_holds_an_adapter_in_the_models_dtype():
    from vllm.config import LoRAConfig

    config = LoRAConfig(max_lora_rank=8)  # lora_dtype "auto", as `vllm serve --enable-lora` leaves it
    config.verify_with_model_config(SimpleNamespace(dtype=torch.bfloat16, architectures=["LlamaForCausalLM"]))
    assert config.lora_dtype == torch.bfloat16


def test_bf16_files_load_in_vllm_bit_equal_to_fp32_files(tmp_path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from grpo_accel.data.models import build_tiny_model, load_tokenizer

    model = build_tiny_model("tiny-llama", load_tokenizer("tiny-llama"), dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_()  # fp32 values with bits past bf16's mantissa: the cast must round as vLLM's does
    with serve() as (url, handler):
        folders = {}
        for label, dtype in (("fp32", None), ("bf16", base_dtype(model))):
            sync = AdapterSync(url, tmp_path / label, api_key="secret", dtype=dtype)
            folders[label] = handler.loaded[sync.push(model, 1)]

    held = {}
    for label, folder in folders.items():
        helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
        held[label] = LoRAModel.from_local_checkpoint(str(folder), PROJECTIONS, peft_helper=helper, lora_model_id=1,
                                                      device="cpu", dtype=torch.bfloat16).loras
    assert held["fp32"].keys() == held["bf16"].keys() and len(held["fp32"]) == 2 * len(PROJECTIONS)
    for name, wide in held["fp32"].items():
        narrow = held["bf16"][name]
        for a, b in ((wide.lora_a, narrow.lora_a), (wide.lora_b, narrow.lora_b)):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    full = load_file(folders["fp32"] / "adapter_model.safetensors")  # the fp32 file had bits for vLLM to round away
    assert all(t.dtype == torch.float32 and not torch.equal(t, t.bfloat16().float()) for t in full.values())
    narrow = load_file(folders["bf16"] / "adapter_model.safetensors")
    assert narrow.keys() == full.keys() and all(t.dtype == torch.bfloat16 for t in narrow.values())
