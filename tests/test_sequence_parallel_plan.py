"""The planner under Ulysses sequence parallelism (grpo_accel.memory.plan_memory(sequence_parallel_size=...)):
per-GPU activations fall by SP, the all-to-all buffers appear, generation's KV cache stays whole, SP = 1 is
unchanged; and what it predicts for Qwen3-8B QLoRA on 8 x H100 (a prediction, not a measurement)."""

from grpo_accel.memory import GIB, find_max_completion_length, plan_memory
from grpo_accel.presets import PRESETS

KW = dict(dtype="bf16", quantization="4bit", lora_r=16, num_generations=8, max_prompt_length=512,
          max_completion_length=110_000, per_device_train_batch_size=1, offload_activations=True, use_vllm=True,
          vllm_share_weights=False)


def test_sp_divides_activations_and_adds_all_to_all():
    one, sp8 = (plan_memory("qwen3-8b", sequence_parallel_size=sp, **KW) for sp in (1, 8))
    assert plan_memory("qwen3-8b", **KW).device == one.device and one.device["sp_all_to_all"] == 0
    assert abs(sp8.device["activations_checkpointed"] * 8 / one.device["activations_checkpointed"] - 1) < 1e-3
    assert sp8.host["activations_offloaded"] < one.host["activations_offloaded"] / 7.9
    assert sp8.device["logprob_workspace"] < one.device["logprob_workspace"]
    assert sp8.device["sp_all_to_all"] > 0 and sp8.device["vllm_kv_cache"] == one.device["vllm_kv_cache"]


def test_preset_sp8_predictions():
    """Longest completions the planner fits on 80 GB (host: 128 GiB for one process, 16 GiB each for 8)."""
    h100 = PRESETS["h100_110k"]
    single, _ = find_max_completion_length(h100.plan(), 80 * 10**9, 128 * GIB)
    sp8, _ = find_max_completion_length(h100.plan(sequence_parallel_size=8, num_processes=8, deepspeed_stage=2),
                                        80 * 10**9, 16 * GIB)
    # colocated vLLM holds one whole sequence's KV on each GPU: generation, not training, bounds both
    assert 250_000 < single < sp8 < 350_000
    # training side alone (no vLLM): SP = 8 fits > 1.5x the single GPU's, not 8x (the shard's re-run is whole)
    train1, _ = find_max_completion_length(h100.plan(use_vllm=False), 80 * 10**9, 128 * GIB)
    train8, _ = find_max_completion_length(h100.plan(use_vllm=False, sequence_parallel_size=8, num_processes=8,
                                                     deepspeed_stage=2), 80 * 10**9, 16 * GIB)
    assert train8 > 1.5 * train1
    assert PRESETS["8xh100_sp8"].max_completion_length < sp8
