"""Planner terms for offload (grpo_accel/planning/memory.py) against what the stash does: the residency split measured
by the tracker, sequence tiles shrinking the re-run term, and the longest completion that fits a GPU and a host.

    OMP_NUM_THREADS=1 pytest tests/test_memory_offload.py -q
"""

import dataclasses

import pytest
import torch
from support.offload_model import FORCED, LAYER_BYTES, B, T, V, tiny_llama

from grpo_accel.core.units import GIB
from grpo_accel.planning.architectures import model_shape
from grpo_accel.planning.fitting import find_max_completion_length, fit_host
from grpo_accel.planning.memory import plan_memory


@pytest.mark.parametrize("kept_layers", [0, 1, 3])
def test_planned_residency_matches_the_stash(kept_layers):
    """fp32 tiny Llama, 6 layers: the planner's host term equals the bytes the stash actually moved to host, and its
    device term the stash's device bytes plus the head's input (checkpointing keeps that one as well)."""
    from grpo_accel.offload import SavedActivationTracker, install_activation_offload

    L = 6
    model = tiny_llama(layers=L)
    install_activation_offload(model, dataclasses.replace(FORCED, device_budget_bytes=kept_layers * LAYER_BYTES))
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    with SavedActivationTracker() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        measured = dict(tracker.bytes)
    del loss
    plan = plan_memory(model_shape(model.config), model_dtype="fp32", lora_r=0, per_device_train_batch_size=B,
                       max_prompt_length=0, max_completion_length=T, offload_activations=True, device="cpu",
                       offload_device_budget_bytes=kept_layers * LAYER_BYTES)
    assert plan.host["activations_offloaded"] == measured["host"]
    assert plan.device["activations_checkpointed"] == measured["device"] + LAYER_BYTES


def test_tiles_bound_the_rerun_of_one_long_row():
    """One Qwen3-8B row of 110K tokens: whole, the re-run term is the 33 GiB of the issue; in 16K tiles it is one
    tile's plus the full-length d(out), d(in), K, V, dK, dV, and it grows linearly (not with T x tile) in T."""
    kw = dict(model_dtype="bf16", quantization="4bit", lora_r=16, per_device_train_batch_size=1, max_prompt_length=512,
              offload_activations=True)
    whole = plan_memory("qwen3-8b", max_completion_length=110_000, offload_recompute_tokens=None, **kw)
    tiled = [plan_memory("qwen3-8b", max_completion_length=t, **kw).device["recompute_working_set"]
             for t in (110_000, 220_000)]
    assert whole.device["recompute_working_set"] / GIB == pytest.approx(32.9, rel=0.02)
    assert tiled[0] < whole.device["recompute_working_set"] / 4
    shape = model_shape("qwen3-8b")
    per_token = 2 * shape.hidden * 2 + 2 * shape.kv_dim * 6
    assert tiled[1] - tiled[0] == pytest.approx(110_000 * per_token)


def test_longest_completion_fits_and_one_step_more_does_not():
    # generation on another machine (a vLLM server): the training step's own limits, GPU and host
    kw = dict(model_dtype="bf16", quantization="4bit", lora_r=16, per_device_train_batch_size=1, max_prompt_length=512,
              offload_activations=True, generation="vllm_server")
    plan, gpu, host = plan_memory("qwen3-8b", **kw), int(79 * GIB), int(110 * GIB)
    t, fitted = find_max_completion_length(plan, gpu, host)
    assert t % 128 == 0 and fitted.inputs["max_completion_length"] == t
    assert fitted.peak_bytes <= gpu and sum(fitted.host.values()) <= host
    more = fit_host(plan.replan(max_completion_length=t + 128), host)
    assert more.peak_bytes > gpu or sum(more.host.values()) > host
    # the host cap binds: what it cannot hold stays on the GPU (residency), and a bigger host lets T grow
    assert fitted.inputs["offload_device_budget_bytes"] > 0
    assert find_max_completion_length(plan, gpu, 2 * host)[0] > t
    # tiles are what make a long row fit at all: whole re-runs stop far earlier
    assert find_max_completion_length(plan.replan(offload_recompute_tokens=None), gpu, host)[0] < t / 2
    # without offload, no host term and a much shorter limit
    assert find_max_completion_length(plan.replan(offload_activations=False), gpu, host)[0] < t / 3
    assert find_max_completion_length(plan, int(1 * GIB)) == (0, None)


