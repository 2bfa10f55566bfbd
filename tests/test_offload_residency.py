"""Residency of offloaded layer inputs (grpo_accel/offload/residency.py): a device budget keeps the first inputs on
the device, a host budget stops the stash with an error naming the fix, reloads reuse two pooled buffers. CPU tier:
the real copy path forced as GRPO_ACCEL_OFFLOAD_FORCE_COPIES does in the trainer.

    OMP_NUM_THREADS=1 pytest tests/test_offload_residency.py -q
"""

import dataclasses

import pytest
import torch
from support.compare import assert_equal
from support.offload_model import FORCED, LAYER_BYTES, B, T, V, tiny_llama

from grpo_accel.offload import SavedActivationTracker, install_activation_offload
from grpo_accel.offload.residency import HostMemoryError, check_host_memory, host_available_bytes

L = 6


def run(cfg, steps=1, tokens=T):
    model = tiny_llama(layers=L)
    ckpt = install_activation_offload(model, cfg)
    ids = torch.randint(0, V, (B, tokens), generator=torch.Generator().manual_seed(2))
    peaks = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with SavedActivationTracker() as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            fwd = dict(tracker.bytes)
            tracker.reset_peak()
            loss.backward()
        assert tracker.bytes == {"device": 0, "host": 0}
        peaks.append((fwd, dict(tracker.peak)))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, peaks, ckpt.stash


def test_device_budget_keeps_the_first_inputs_and_grads_are_identical():
    ref, [(fwd, _)], _ = run(FORCED)
    assert fwd == {"device": LAYER_BYTES, "host": (L - 1) * LAYER_BYTES}  # the newest only
    kept = dataclasses.replace(FORCED, device_budget_bytes=2 * LAYER_BYTES)
    grads, [(fwd, bwd)], stash = run(kept)
    assert fwd == {"device": 3 * LAYER_BYTES, "host": (L - 3) * LAYER_BYTES}  # 2 kept + the newest
    assert bwd["host"] == (L - 3) * LAYER_BYTES and stash.host_bytes == 0
    assert_equal(ref, grads)


def test_host_budget_raises_naming_the_fix_and_the_device_budget_relieves_it():
    tight = dataclasses.replace(FORCED, host_budget_bytes=2 * LAYER_BYTES)
    with pytest.raises(HostMemoryError, match="lower max_completion_length.*keep more layer inputs on the GPU"):
        run(tight)
    assert issubclass(HostMemoryError, ValueError)
    # 3 inputs kept on the device + the newest leave L - 4 = 2 for the host: fits exactly
    run(dataclasses.replace(tight, device_budget_bytes=3 * LAYER_BYTES))


def test_pinned_copies_count_the_pinned_allocators_power_of_two_blocks(monkeypatch):
    """torch's CachingHostAllocator rounds every pinned block up to a power of two (ATen/core/CachingHostAllocator.h,
    PowerOf2Ceil): a 2.3 GiB layer input holds 4 GiB. The host budget must count the blocks, or 36 such inputs pass
    a budget of 90% of 128 GiB and meet the OOM killer (issue 35: a benchmark worker killed by signal 9)."""
    import grpo_accel.offload.stash as stash_mod

    # pinned as on CUDA; the copy itself unpinned (no GPU here)
    policy, copy = stash_mod.offload_policy, stash_mod._copy
    monkeypatch.setattr(stash_mod, "offload_policy", lambda t, cfg, m: (policy(t, cfg, m)[0], True, False))
    monkeypatch.setattr(stash_mod, "_copy", lambda src, device, pin, stream: copy(src, device, False, stream))
    layer = B * 12 * 32 * 4  # one 12-token input: 3072 bytes, in a 4096-byte pinned block
    with pytest.raises(HostMemoryError):  # the L - 1 offloaded inputs' bytes, not their blocks
        run(dataclasses.replace(FORCED, host_budget_bytes=(L - 1) * layer), tokens=12)
    _, _, stash = run(dataclasses.replace(FORCED, host_budget_bytes=(L - 1) * 4096), tokens=12)
    assert stash.host_bytes == 0  # every block given back after backward


def test_reloads_reuse_two_pooled_buffers_across_layers_and_steps():
    ref, _, _ = run(FORCED)
    grads, peaks, stash = run(FORCED, steps=3)
    assert stash.pool.allocated == 2  # double buffer: 5 reloads per step, 3 steps, 2 allocations
    assert stash.pool.free_bytes == 2 * LAYER_BYTES
    assert all(bwd["device"] == 2 * LAYER_BYTES for _, bwd in peaks)
    assert_equal(ref, grads)


def test_check_host_memory():
    gib = 1 << 30
    check_host_memory(80 * gib, have_bytes=100 * gib)
    with pytest.raises(HostMemoryError, match=r"need 147\.0 GiB of host memory, this host has 115\.2 GiB"):
        check_host_memory(147 * gib, have_bytes=128 * gib)
    assert host_available_bytes() > 0


@pytest.mark.parametrize("local_ranks", [1, 2, 8])
def test_host_budget_is_shared_by_the_ranks_of_a_node(local_ranks, monkeypatch):
    """k processes on one machine (LOCAL_WORLD_SIZE = k) each stash up to their trainer's host budget: the k budgets
    together stay within the node's limit (90% of MemAvailable), as the start-up check already plans them."""
    from types import SimpleNamespace

    from grpo_accel.offload import residency
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    node_available = 100 * 2**30
    monkeypatch.setattr(residency, "meminfo_bytes", lambda key: node_available if key == "MemAvailable" else None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.delenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", raising=False)
    from grpo_accel.core.settings import RunSettings

    args = SimpleNamespace(offload_activations="true", gradient_checkpointing=True, offload_recompute_tokens=1024,
                           offload_device_budget_gib=0.0)
    fake = SimpleNamespace(args=args, settings=RunSettings.resolve(args, cuda=True),
                           accelerator=SimpleNamespace(device=torch.device("cuda")))  # the GPU path, no GPU touched
    budget = GRPOAccelTrainer._offload_config(fake).host_budget_bytes
    assert budget * local_ranks <= 0.9 * node_available
    assert budget * local_ranks >= 0.89 * node_available  # shared, not shrunk further
    from grpo_accel.app.runner import offload_line  # the start-up line says the per-process figure

    fake.offload_enabled, fake.offload_config = True, SimpleNamespace(host_budget_bytes=budget)
    assert f"host budget {budget / 2**30:.1f} GiB per process" in offload_line(fake)
    assert f"/ {local_ranks} process(es)" in offload_line(fake)
