"""The vLLM server's own plan (route vllm_server, grpo_accel/planning/server.py): the server machine's GPUs and how many
full-length sequences its KV pool holds, printed by `grpo-accel plan` for a server preset."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from grpo_accel.app import cli
from grpo_accel.app.presets import list_presets
from grpo_accel.core.units import GIB
from grpo_accel.planning.architectures import model_shape
from grpo_accel.planning.server import TENSOR_PARALLEL_SIZES, plan_server


def test_kv_per_sequence_is_what_a_real_cache_holds():
    """The pool is priced per full-length sequence: ModelShape.kv_cache_bytes against the bytes of transformers' own
    cache after a forward of that many tokens (an independent count: the tensors, not a formula)."""
    from grpo_accel.data.models import build_tiny_model, load_tokenizer

    model = build_tiny_model("tiny-qwen3", load_tokenizer("tiny-qwen3"), dtype=torch.bfloat16).eval()
    T = 37
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, T)), cache=cache, use_cache=True)
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    plan = plan_server(model_shape("tiny-qwen3"), model="m", max_model_len=T, generation_batch=1, gpu_bytes=GIB)
    assert plan.kv_bytes_per_sequence == real


@pytest.mark.parametrize("length", [32_768, 110_512, 500_512])
def test_fewest_gpus_that_decode_the_batch_at_once(length):
    """Chosen: the smallest tensor-parallel size whose pool holds the whole batch at full length; where none does,
    the largest. Checked by building each size's budget from the plan's own terms (weights and runtime per GPU)."""
    gpu = int(79.1 * GIB)
    shape = model_shape("qwen3-8b")
    plan = plan_server(shape, model="m", max_model_len=length, generation_batch=8, gpu_bytes=gpu)

    def holds(tp):  # what tp GPUs leave for KV at vLLM's utilization, in full-length sequences
        rest = tp * (0.9 * gpu - plan.runtime_bytes / plan.tensor_parallel_size) - plan.weights_bytes
        return int(rest // plan.kv_bytes_per_sequence)

    assert plan.fits and plan.sequences_at_once == holds(plan.tensor_parallel_size)
    smaller = [tp for tp in TENSOR_PARALLEL_SIZES if tp < plan.tensor_parallel_size]
    assert all(holds(tp) < 8 for tp in smaller)
    assert plan.sequences_at_once >= 8 or plan.tensor_parallel_size == TENSOR_PARALLEL_SIZES[-1]


def test_a_model_with_few_kv_heads_is_not_split_past_them_and_too_long_is_refused():
    shape = dataclasses.replace(model_shape("qwen3-8b"), kv_heads=2)
    plan = plan_server(shape, model="m", max_model_len=2_000_000, generation_batch=8, gpu_bytes=80 * GIB)
    assert plan.tensor_parallel_size <= 2
    huge = plan_server(model_shape("qwen3-8b"), model="m", max_model_len=20_000_000, generation_batch=8,
                       gpu_bytes=80 * GIB)
    assert not huge.fits and "shorten --max_completion_length" in huge.format()


def test_every_server_preset_states_its_gpus_and_the_plan_prints_the_server(capsys):
    """docs/several-gpus.md: a vllm_mode server preset says how many generation GPUs it expects; `grpo-accel plan`
    sizes that machine apart from the training side and prints the command to start it."""
    servers = [p for p in list_presets() if p.vllm_mode == "server"]
    assert servers, "no server preset: this test checks nothing"
    for preset in servers:
        assert preset.server_gpus > 0, preset.name
        cli.main(["plan", "--preset", preset.name])
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("vLLM server (its own machine):"))
        gpus = int(line.split(": ")[1].split(" GPU")[0])
        assert 1 <= gpus <= preset.server_gpus, (preset.name, line)
        length = preset.max_prompt_length + preset.max_completion_length
        if preset.lora_r:  # adapter-only sync: vLLM's own server, adapters loaded at run time (server_generation)
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve " in out and "--enable-lora" in out
            assert f"--tensor-parallel-size {gpus} " in out and f"--max-model-len {length} " in out
            # the rank the trainer's adapter has; the version training and the one sampling ahead (max_staleness 1)
            assert f"--max-lora-rank {preset.lora_r} " in out and "--max-loras 2 " in out
            assert "--logprobs-mode processed_logprobs" in out  # behaviour log-probs after temperature
        else:  # full fine-tuning: TRL's server, every weight over NCCL
            assert f"--tensor_parallel_size {gpus} " in out and f"--max_model_len {length} " in out
