"""Engine sizing and the sharing decision (vllm_setup.py) without an engine: runs in the main venv.

The engine itself is exercised in tests/vllm_engine (make test-vllm); here the arithmetic and the choices.
"""

import types

import pytest
import torch

from grpo_accel.data.datasets import train_eval_datasets
from grpo_accel.data.models import embedded_model_dir, load_tokenizer
from grpo_accel.generation import vllm_setup as vs
from grpo_accel.planning.architectures import model_shape
from grpo_accel.trainer.config import GRPOAccelConfig


@pytest.fixture(scope="module")
def hf_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(embedded_model_dir())


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8,
                num_generations=4, max_completion_length=40)
    return GRPOAccelConfig(**(base | kw))


def test_max_model_len_is_longest_prompt_plus_completion(tmp_path, hf_config):
    tok = load_tokenizer("smollm2-135m-instruct")
    train, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=0)
    longest = max(len(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False))
                  for p in train["prompt"])
    assert vs.max_model_len(_args(tmp_path), hf_config, train, tok) == max(longest + 40, vs.MIN_MODEL_LEN)
    assert vs.max_model_len(_args(tmp_path, vllm_max_model_length=300), hf_config, train, tok) == 300
    # The runner's already measured longest prompt is used as is (no second tokenization of the dataset).
    assert vs.max_model_len(_args(tmp_path), hf_config, longest_prompt=longest) == max(longest + 40, vs.MIN_MODEL_LEN)
    # No dataset: the model's context.
    assert vs.max_model_len(_args(tmp_path), hf_config) == hf_config.max_position_embeddings


def test_cpu_kv_cache_is_sized_to_the_step(tmp_path, hf_config):
    args = _args(tmp_path, gradient_accumulation_steps=2)
    cfg, why = vs.engine_config(args, hf_config, dtype=torch.float32, lora_r=16, route="vllm_shared",
                                model_len=200)
    shape = model_shape(hf_config)
    per_token = 2 * shape.layers * shape.kv_dim * 4  # K and V, fp32
    assert cfg.max_num_seqs == 16  # 8 per device x 2 steps per generation (TRL's own max_num_seqs)
    assert cfg.kv_cache_bytes == 16 * (200 + vs.CPU_KV_BLOCK) * per_token
    assert cfg.max_lora_rank == 16 and not cfg.sleep and cfg.quantization is None
    assert "KV cache" in why and "16 sequences" in why


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_engine_seed_follows_trls_rule(tmp_path, hf_config, monkeypatch, rank):
    """Each process's colocated engine samples from its own seed, as TRL seeds its colocated engines (by process
    index, over tensor-parallel groups; ours are 1 GPU): ranks sharing a seed sample identical completions for the
    copies of a prompt they each hold. A TRL release that changes its rule fails the first assertion."""
    import inspect

    from trl.generation import vllm_generation

    assert "seed=accelerator.process_index // self.tensor_parallel_size" in inspect.getsource(vllm_generation)
    monkeypatch.setenv("RANK", str(rank))
    cfg, _ = vs.engine_config(_args(tmp_path, seed=42), hf_config, dtype=torch.float32, lora_r=16,
                              route="vllm_shared", model_len=200)
    assert cfg.seed == rank // 1  # vllm_tensor_parallel_size is 1 (others are refused at start-up)


def _fake_gpu(monkeypatch, total_bytes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=total_bytes))


def test_cuda_fraction_comes_from_the_planner(tmp_path, hf_config, monkeypatch):
    """On a (faked) 80 GB GPU the engine gets what training leaves: less when training needs more, enough for one
    full-length sequence of KV beside its weights; full fine-tuning sleeps; a fraction the user chose is kept."""
    from grpo_accel.planning.generation import kv_bytes_per_token
    from grpo_accel.planning.memory import _weights_bytes

    args, long_args = _args(tmp_path), _args(tmp_path, max_completion_length=4000)
    chosen = _args(tmp_path, vllm_gpu_memory_utilization=0.5)  # built before the fake GPU
    gpu = 80 * 2**30
    _fake_gpu(monkeypatch, gpu)
    shape = model_shape(hf_config)
    fractions = {}
    for name, a, model_len in (("short", args, 512), ("long", long_args, 4472)):
        for lora_r, shared in ((16, True), (0, False)):
            cfg, why = vs.engine_config(a, hf_config, dtype=torch.bfloat16, lora_r=lora_r,
                                        route="vllm_shared" if shared else "vllm_copy", model_len=model_len)
            engine_needs = _weights_bytes(shape, 2, "none") + model_len * kv_bytes_per_token(shape, 2)
            assert 0.3 != cfg.memory_fraction < 1 and cfg.memory_fraction * gpu > engine_needs
            assert cfg.sleep is (not shared) and "memory planner" in why
            fractions[name, lora_r] = cfg.memory_fraction
    assert fractions["long", 16] < fractions["short", 16]  # longer completions: training keeps more
    cfg, why = vs.engine_config(chosen, hf_config, dtype=torch.bfloat16, lora_r=16, route="vllm_shared",
                                model_len=512)
    assert cfg.memory_fraction == 0.5 and "as given" in why


def test_engine_that_does_not_fit_names_the_fix(tmp_path, hf_config, monkeypatch):
    args = _args(tmp_path, max_completion_length=8192)
    _fake_gpu(monkeypatch, 2**30)
    with pytest.raises(vs.VLLMSetupError, match="does not fit beside training"):
        vs.engine_config(args, hf_config, dtype=torch.bfloat16, lora_r=16, route="vllm_shared",
                         model_len=8192 + 64)


def test_models_without_a_checkpoint_name_the_fix():
    with pytest.raises(vs.VLLMSetupError, match="checkpoint directory.*Fix"):
        vs.model_directory("tiny-llama")
    assert vs.model_directory("smollm2-135m-instruct") == str(embedded_model_dir())


def test_route_on_this_machine_names_the_fix(tmp_path):
    """The route the runner and the trainer take here is the planner's rule on this machine's stack: without vLLM
    (the main venv) generate(), with one line naming what to install; a 4-bit model takes the same decision."""
    four_bit = torch.nn.Linear(2, 2)
    four_bit.is_loaded_in_4bit = True
    stack = vs.local_stack()
    action, line = vs.colocated_route(four_bit, _args(tmp_path, use_vllm=True))
    if not stack.vllm:  # the main venv: no vLLM at all
        assert action == "fallback" and line.startswith("generation route generate:") and "Fix: pip install" in line
    else:
        assert action == "from_model" and line == ("vllm_4bit" if stack.bnb_4bit else "vllm_fp8" if stack.cuda
                                                   else line)


def test_unsupported_options_are_refused_in_one_line():
    """TRL options its own colocate engine honours and the shared one does not: named with their values, never
    dropped; the start-up check, the engine's route and SharedVLLMGeneration all say this line."""
    from types import SimpleNamespace

    from grpo_accel.generation.vllm_colocate import unsupported_options

    defaults = dict(vllm_structured_outputs_regex=None, vllm_tensor_parallel_size=1, vllm_model_impl="vllm")
    assert unsupported_options(SimpleNamespace(**defaults)) is None
    line = unsupported_options(SimpleNamespace(**{**defaults, "vllm_structured_outputs_regex": "a+",
                                                  "vllm_tensor_parallel_size": 2}))
    assert "vllm_structured_outputs_regex='a+', vllm_tensor_parallel_size=2." in line and "--vllm_mode server" in line


def test_engine_quantization_follows_the_route(tmp_path, hf_config, monkeypatch):
    """The engine's EngineArgs quantization is the route's: vllm-bnb-plugin's bitsandbytes for vllm_4bit, vLLM's
    online FP8 for vllm_fp8, the checkpoint's dtype when it shares; sized on CUDA by the plan of that route (the
    4-bit trainer beside an engine copy: its own weights count against the fraction)."""
    args = _args(tmp_path)
    _fake_gpu(monkeypatch, 4 * 2**30)  # small enough that the 0.95 cap does not hide the difference
    got = {}
    for route in ("vllm_4bit", "vllm_fp8", "vllm_shared"):
        cfg, why = vs.engine_config(args, hf_config, dtype=torch.bfloat16, lora_r=16, route=route, model_len=512)
        got[route] = cfg
        assert "memory planner" in why and not cfg.sleep
    assert [got[r].quantization for r in got] == ["bitsandbytes", "fp8", None]
    # the same 4-bit trainer leaves the same room, so the two engine copies get the same fraction; sharing differs
    assert got["vllm_4bit"].memory_fraction == got["vllm_fp8"].memory_fraction != got["vllm_shared"].memory_fraction
