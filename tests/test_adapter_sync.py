"""Adapter-only sync to a vLLM server (grpo_accel/generation/adapter_sync.py) against a stand-in of vLLM 0.32's
routes (support/vllm_standin.py). What a stand-in cannot show, that a real server's completions come from the
adapter just loaded, is the vLLM tier's test (tests/vllm_engine/test_vllm_server.py)."""

import pytest
import torch
from support.vllm_standin import serve

from grpo_accel.core.errors import UserError
from grpo_accel.generation.adapter_sync import API_KEY_ENV, AdapterSync, base_dtype


@pytest.fixture
def server():
    with serve() as (url, handler):
        yield url, handler


def lora_model(dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    from grpo_accel.data.models import build_tiny_model, load_tokenizer

    model = build_tiny_model("tiny-llama", load_tokenizer("tiny-llama"), dtype=dtype)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_each_version_loads_under_its_own_name_and_old_ones_go(server, tmp_path):
    url, handler = server
    sync = AdapterSync(url, tmp_path, keep=2, api_key="secret")
    sync.check()
    model = lora_model()
    names = [sync.push(model, v) for v in (1, 2, 3)]
    assert names == [f"policy-{sync.run_id}-v{v}" for v in (1, 2, 3)]
    assert sorted(handler.loaded) == names[1:]  # v1 unloaded, its folder removed
    assert sorted(p.name for p in tmp_path.iterdir()) == names[1:]
    # only the adapter moves: its bytes against the whole model's (the goal is <= 1/100 at 8B; a tiny
    # model's adapter is a larger share, so this checks the folder holds the adapter and not the base)
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    base = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    assert adapter <= sync.bytes_sent / 3 < adapter + 64 * 1024 and sync.bytes_sent / 3 < base / 4
    with pytest.raises(ValueError, match="versions only grow"):
        sync.push(model, 3)


def test_a_pushed_adapter_is_the_models_own(server, tmp_path):
    """What the server reads back is the trained adapter: its tensors equal the model's at push time."""
    from safetensors.torch import load_file

    url, handler = server
    sync = AdapterSync(url, tmp_path, api_key="secret")
    model = lora_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    sync.push(model, 5)
    saved = load_file(handler.loaded[sync.name_of(5)] / "adapter_model.safetensors")
    own = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(saved) == len(own) > 0
    for name, tensor in saved.items():
        match = [p for n, p in own.items() if n.replace(".default", "").endswith(name.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0], tensor), name


@pytest.mark.parametrize("key", [None, "wrong"])
def test_a_missing_or_wrong_key_is_one_error_naming_the_variable(server, tmp_path, key, monkeypatch):
    url, _ = server
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(UserError, match=API_KEY_ENV + (" is not set" if key is None else " does not match")):
        AdapterSync(url, tmp_path, api_key=key).check()


def test_a_server_without_runtime_lora_names_the_flags(server, tmp_path):
    url, handler = server
    handler.lora_routes = False
    with pytest.raises(UserError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve BASE --enable-lora"):
        AdapterSync(url, tmp_path, api_key="secret").check()


def test_a_dead_server_is_an_error_within_the_timeout(tmp_path):
    with pytest.raises(UserError, match="did not answer within 2 s"):
        AdapterSync("http://127.0.0.1:9", tmp_path, api_key="k", timeout_s=2).check()


def test_an_adapter_the_server_cannot_read_names_the_shared_folder(server, tmp_path):
    url, handler = server
    handler.fail_load = True
    with pytest.raises(UserError, match="readable on the server's machine"):
        AdapterSync(url, tmp_path, api_key="secret").push(lora_model(), 1)


def test_a_resumed_run_loads_its_versions_beside_the_dead_runs(server, tmp_path):
    """A run resumed from its checkpoint (or a second run) against a server that outlived the first: the same
    versions come again, and vLLM refuses a name it holds (HTTP 400 "already been loaded"); reloading it in place
    would mix the weights under requests still decoding. Each run names its own versions."""
    url, handler = server
    first, resumed = (AdapterSync(url, tmp_path / name, api_key="secret") for name in ("a", "b"))
    model = lora_model()
    names = [first.push(model, 1), resumed.push(model, 1)]
    assert names[0] != names[1] and sorted(handler.loaded) == sorted(names)


def test_a_bf16_base_gets_bf16_files_and_the_trainers_adapter_stays_fp32(server, tmp_path):
    """PEFT keeps the adapter in fp32 over a bf16 base; vLLM casts it to the served model's dtype on load, so the
    files carry the cast (half the bytes) while the trainer's own adapter keeps every bit. An fp32 run's files are
    byte for byte today's (no dtype)."""
    from safetensors.torch import load_file

    url, handler = server
    model = lora_model(torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_()  # bits past bf16's mantissa in every element
    own = {n: p for n, p in model.named_parameters() if "lora_" in n}
    before = {n: (p.detach().clone(), p.data_ptr()) for n, p in own.items()}
    assert base_dtype(model) == torch.bfloat16 and {p.dtype for p in own.values()} == {torch.float32}
    narrow, wide = AdapterSync(url, tmp_path / "bf16", api_key="secret", dtype=base_dtype(model)), \
        AdapterSync(url, tmp_path / "fp32", api_key="secret")
    narrow.push(model, 1), wide.push(model, 1)
    saved, full = (load_file(handler.loaded[s.name_of(1)] / "adapter_model.safetensors") for s in (narrow, wide))
    assert saved.keys() == full.keys() and len(saved) == len(own)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name
    for n, p in own.items():  # the trainer's adapter: same storage, same fp32 values
        assert p.dtype == torch.float32 and p.data_ptr() == before[n][1] and torch.equal(p, before[n][0]), n
    adapter_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert abs(wide.bytes_sent - narrow.bytes_sent - adapter_bytes // 2) < 64  # the headers' dtype names differ

    fp32 = lora_model()
    assert base_dtype(fp32) == torch.float32
    today, cast = AdapterSync(url, tmp_path / "a", api_key="secret"), \
        AdapterSync(url, tmp_path / "b", api_key="secret", dtype=base_dtype(fp32))
    today.push(fp32, 2), cast.push(fp32, 2)
    files = [(handler.loaded[s.name_of(2)] / "adapter_model.safetensors").read_bytes() for s in (today, cast)]
    assert files[0] == files[1]
