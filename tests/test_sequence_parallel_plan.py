"""The planner under Ulysses sequence parallelism (grpo_accel.planning.memory.plan_memory(sequence_parallel_size=...))
as grpo_accel.parallel.sequence_parallel runs it: an SP group shares its rows, so each GPU holds T/sp tokens of each
(checkpointed layer inputs and scored tokens fall by sp), re-runs a long shard in sequence tiles, and adds the
all-to-all buffers; a colocated engine's KV cache (whole sequences) does not shrink. And what it predicts for Qwen3-8B
QLoRA on 8 x H100 with SP = 8 against one H100 (predictions, not measurements: no multi-GPU machine has run them)."""

from grpo_accel.app.presets import PRESETS
from grpo_accel.core.units import GIB
from grpo_accel.planning.fitting import find_max_completion_length
from grpo_accel.planning.memory import plan_memory

KW = dict(model_dtype="bf16", quantization="4bit", lora_r=16, num_generations=8, max_prompt_length=512,
          max_completion_length=110_000, per_device_train_batch_size=1, offload_activations=True, use_vllm=True,
          vllm_share_weights=False)
H100 = 80 * 10**9


def test_sp_divides_tokens_per_gpu_adds_all_to_all():
    one, sp8 = (plan_memory("qwen3-8b", sequence_parallel_size=sp, **KW) for sp in (1, 8))
    assert plan_memory("qwen3-8b", **KW).device == one.device and one.device["sp_all_to_all"] == 0
    # 110,512 tokens = 8 shards of 13,814: the offloaded layer inputs per GPU fall 8x
    assert sp8.host["activations_offloaded"] * 8 == one.host["activations_offloaded"]
    assert sp8.device["logprob_workspace"] < one.device["logprob_workspace"]
    assert sp8.device["recompute_working_set"] < one.device["recompute_working_set"]
    assert sp8.device["sp_all_to_all"] > 0 and sp8.device["vllm_kv_cache"] == one.device["vllm_kv_cache"]


def test_sp_tiles_a_long_shard():
    """A 500K-token row over 8 GPUs: 62.6K-token shards, longer than the 16K re-run piece, so each layer's re-run
    runs in sequence tiles (parallel/ulysses_tiles.py) instead of whole (recompute_tokens past the shard)."""
    kw = {**KW, "max_completion_length": 500_000, "use_vllm": None, "vllm_share_weights": None,
          "generation": "vllm_server"}
    tiled = plan_memory("qwen3-8b", sequence_parallel_size=8, **kw)
    whole = plan_memory("qwen3-8b", sequence_parallel_size=8, offload_recompute_tokens=70_000, **kw)
    assert whole.device["recompute_working_set"] > 2.5 * tiled.device["recompute_working_set"]  # 18.6 vs 7.0 GiB
    assert whole.device["sp_all_to_all"] > 3 * tiled.device["sp_all_to_all"]  # a tile's, not the shard's


def test_sp8_prediction_against_one_h100():
    """Longest completion that fits on 80 GB GPUs, Qwen3-8B QLoRA with offload, the same host memory per GPU
    (128 GiB: the one-H100 machine's). One H100: h100_110k (colocated vLLM) and the same without an engine; 8 H100s
    with SP = 8: 8xh100_sp8_512k (generation on a vLLM server node). Predictions, stated as such."""
    single, _ = find_max_completion_length(PRESETS["h100_110k"].plan(), H100, 128 * GIB, limit=1 << 24)
    alone, _ = find_max_completion_length(PRESETS["h100_110k"].plan(generation="vllm_server"), H100, 128 * GIB,
                                          limit=1 << 24)
    sp8, plan = find_max_completion_length(PRESETS["8xh100_sp8_512k"].plan(), H100, 128 * GIB, limit=1 << 24)
    assert 250_000 < single < 300_000  # 273,152: colocated vLLM's whole-sequence KV binds
    assert sp8 >= 8 * single  # 4,473,344: 16.4x h100_110k
    # against one H100 whose generation also runs elsewhere (577,920: its host binds) 7.7x, not 8x: each GPU keeps
    # the weights, and the tiles' whole-sequence K, V (heads/8) and the shard's dq
    assert 7 < sp8 / alone < 8
    assert plan.host["activations_offloaded"] > 120 * GIB  # host-bound, like the single GPU


def test_sp8_512k_preset_fits_with_room():
    plan = PRESETS["8xh100_sp8_512k"].plan()
    assert plan.peak_bytes < 0.3 * H100 and sum(plan.host.values()) < 32 * GIB  # 18.0 GiB, 16.7 GiB host a GPU
    assert plan.device["vllm_kv_cache"] == plan.device["vllm_weights"] == 0  # the server generates elsewhere
