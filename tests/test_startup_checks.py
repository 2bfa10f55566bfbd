"""Every shipped preset starts: its weight-free start-up checks pass, and each check can fail.

    OMP_NUM_THREADS=1 pytest tests/test_startup_checks.py
"""

import pytest

from grpo_accel.app.presets import PRESETS
from grpo_accel.app.run_spec import resolve_run_spec
from grpo_accel.app.startup_checks import context_tokens, model_config, run_checks
from grpo_accel.core.units import GIB


def failures(argv, gpu_gib=None):
    """The start-up checks of a run on its machine with the vllm extra installed (routes.PINNED_STACK)."""
    from grpo_accel.planning.routes import PINNED_STACK

    spec = resolve_run_spec(argv, for_plan=True)
    spec.stack = PINNED_STACK
    gpu = gpu_gib if gpu_gib is not None else spec.preset.min_gpu_mem_gib
    return run_checks(spec, model_config(spec, prefer_named=True), spec.preset.max_prompt_length,
                      int(gpu * GIB) if gpu else None)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_passes_its_startup_checks(name, monkeypatch):
    """Context (rope scaling included), attention mask at the planned length, engine vs the distributed setup,
    sequence parallelism vs the heads, memory on the preset's smallest GPU: a preset that cannot start fails here,
    not on a rented GPU. (vLLM installed counts as given: that is an install step, checked below.)"""
    monkeypatch.setattr("grpo_accel.generation.vllm_availability.vllm_unavailable_reason", lambda: None)
    assert failures(["--preset", name]) == []


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "h100_110k", "--model_init_kwargs", "{}"], r"context: 512 prompt \+ 110000 .* context of 40960"),
    (["--preset", "h100_110k", "--padding_free", "false"], r"attention mask: .* 11\.4 GiB .* --padding_free true"),
    (["--preset", "h100_110k", "--model_init_kwargs", '{"attn_implementation": "eager", "rope_parameters": '
      '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}}'],
     r"attention mask: .*attention implementation 'eager' has no packed path"),  # packing would fall back
    (["--preset", "8xh100_zero3", "--use_vllm", "true"], r"colocated vLLM under DeepSpeed ZeRO-3"),
    (["--preset", "a100_40gb_lora", "--vllm_tensor_parallel_size", "2"], r"does not support vllm_tensor_parallel"),
    (["--preset", "a100_40gb_lora", "--max_completion_length", "120000"],
     r"memory: generation route vllm_shared \(.*\); this run does not fit"),
    (["--preset", "8xh100_sp8_512k", "--sequence_parallel_size", "3"], r"32 attention heads are not divisible by"),
    (["--preset", "8xh100_sp8_512k", "--model_init_kwargs", '{"attn_implementation": "eager", "rope_parameters": '
      '{"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}}'],
     r"sequence parallelism: attn_implementation='eager'"),
    (["--preset", "8xh100_sp8_512k", "--quantization", "none", "--lora_r", "0"],
     r"this machine lacks vLLM .* client for --vllm_mode server with full fine-tuning"),  # machine_checks
])
def test_each_check_can_fail(argv, expected):
    import re

    found = failures(argv)
    assert any(re.search(expected, f) for f in found), found


def test_yarn_rope_scaling_extends_the_context():
    spec = resolve_run_spec(["--preset", "h100_110k"], for_plan=True)
    assert context_tokens(model_config(spec, prefer_named=True)) == 131072  # 4 x 32768
    plain = resolve_run_spec(["--preset", "h100_110k", "--model_init_kwargs", "{}"], for_plan=True)
    assert context_tokens(model_config(plain, prefer_named=True)) == 40960


def test_rope_parameters_without_theta_is_refused():
    from grpo_accel.core.errors import UserError

    spec = resolve_run_spec(["--preset", "h100_110k", "--model_init_kwargs",
                             '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}'], for_plan=True)
    with pytest.raises(UserError, match="no rope_theta"):
        model_config(spec, prefer_named=True)


def test_host_memory_is_checked_before_any_load():
    """36 layers x 110K tokens of Qwen3-8B inputs go to host memory (29.5 GiB): a small host pushes them back onto
    the GPU, which an 80 GB GPU absorbs and a 60 GB one does not."""
    assert failures(["--preset", "h100_110k"], gpu_gib=79.1) == []
    from grpo_accel.app.startup_checks import check_memory
    from grpo_accel.planning.routes import PINNED_STACK

    spec = resolve_run_spec(["--preset", "h100_110k"], for_plan=True)
    spec.stack = PINNED_STACK  # the run's machine, with the vllm extra

    assert check_memory(spec, int(79.1 * GIB), int(120 * GIB)) is None
    assert check_memory(spec, int(79.1 * GIB), int(2 * GIB)) is None  # the GPU can keep what the host cannot
    assert check_memory(spec, int(60 * GIB), int(120 * GIB)) is None
    found = check_memory(spec, int(60 * GIB), int(2 * GIB))
    assert found and found.startswith("host memory:") and "--find-max-t" in found
