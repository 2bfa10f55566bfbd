"""The planner under Ulysses sequence parallelism (grpo_accel.memory.plan_memory(sequence_parallel_size=...)) as
grpo_accel.sequence_parallel runs it: data stay data-parallel, so each GPU runs 1/sp of each of its group's sp·B
rows (as many tokens as without SP, in rows of T/sp: row groups, no tiles), plus the all-to-all buffers; generation's
KV cache stays whole. And what it predicts for Qwen3-8B QLoRA on 8 x H100 (a prediction, not a measurement)."""

from grpo_accel.memory import GIB, find_max_completion_length, plan_memory
from grpo_accel.presets import PRESETS

KW = dict(dtype="bf16", quantization="4bit", lora_r=16, num_generations=8, max_prompt_length=512,
          max_completion_length=110_000, per_device_train_batch_size=1, offload_activations=True, use_vllm=True,
          vllm_share_weights=False)


def test_sp_keeps_tokens_per_gpu_shortens_rows_adds_all_to_all():
    one, sp8 = (plan_memory("qwen3-8b", sequence_parallel_size=sp, **KW) for sp in (1, 8))
    assert plan_memory("qwen3-8b", **KW).device == one.device and one.device["sp_all_to_all"] == 0
    # 8 rows of T/8 tokens: the same checkpointed bytes per GPU (T = 110,512 divides by 8)
    assert sp8.device["activations_checkpointed"] == one.device["activations_checkpointed"]
    assert sp8.device["logprob_workspace"] == one.device["logprob_workspace"]
    # a 13.8K-token shard re-runs whole (one row per piece), no full-length tile terms of a 110K row
    assert sp8.device["recompute_working_set"] < one.device["recompute_working_set"]
    assert sp8.device["sp_all_to_all"] > 0 and sp8.device["vllm_kv_cache"] == one.device["vllm_kv_cache"]


def test_sp8_prediction_against_h100_110k():
    """Longest completion on 80 GB: one H100 with 128 GiB host vs 8 with SP = 8 sharing it (16 GiB each)."""
    h100 = PRESETS["h100_110k"]
    single, _ = find_max_completion_length(h100.plan(), 80 * 10**9, 128 * GIB)
    sp8, _ = find_max_completion_length(h100.plan(sequence_parallel_size=8, num_processes=8, deepspeed_stage=2),
                                        80 * 10**9, 16 * GIB)
    assert 250_000 < single < 300_000  # 273,152: colocated vLLM's whole-sequence KV binds
    assert sp8 < single  # 152,064: the same tokens per GPU, an eighth of the host memory each
