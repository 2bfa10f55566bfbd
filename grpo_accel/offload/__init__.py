"""Async activation offload for checkpointed decoder layers (and the hidden states fed to the head).

Naive equivalent: `torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)` on every decoder
layer, which keeps each layer's input x [B, T, H] on the GPU until backward: L·B·T·H·2 bytes in bf16
(43 GB for an 8B model at G=8, T=20K). Here each input is copied to pinned host memory on a side
CUDA stream while the next layer computes, and copied back in backward one layer ahead of need
(double buffer: when layer i's backward starts, the H2D copy of layer i-1's input is queued).
Device-resident saved inputs: ≤ 1 layer during forward (the newest input stays until the next layer
saves, so the last layer's input never leaves), ≤ 2 during backward, plus tensors under `min_bytes`.

Cost: B·T·H·2 bytes per layer each way over PCIe (~25 GB/s on Gen4 x16), against a layer's compute
of ~2·P_layer·B·T FLOPs. Copy/compute ≈ H·F / (25e9·P_layer) for achieved FLOP/s F: ~0.3 for an 8B
model (H=4096, P_layer=218M, F=400 TFLOP/s), ~1 for a 0.5B model (H=896, P_layer=15M), so the copy
hides behind compute for large models; pinned host memory of L·B·T·H·2 bytes is the price.
Why ours and not a library's: torch's `save_on_cpu` (transformers' `activation_checkpointing_enable(offload=True)`)
copies synchronously on the compute stream; benchmarks/bench_step_memory.py runs it side by side as `trl_tuned`
(docs/measurements.md, one GRPO step), where ours leads. TRL 1.16's `OffloadActivations` (torchtune's hooks) is
wired into SFT / DPO / KTO, not GRPO, and offloads every saved tensor rather than the checkpointed layer inputs;
it has not been benchmarked side by side here (a GPU row, pending).

Once the inputs are off the device, the largest term left is one layer's re-run in backward: everything
the layer saves for its own backward, ~230 KB per token for Llama-3.1-8B (15 GB for 8 × 8K tokens). The
backward therefore re-runs a layer one row group (<= `OffloadConfig.recompute_tokens`) at a time: rows
are independent sequences through a decoder layer, so the FLOPs stay the same (H100, Llama-3.1-8B LoRA,
G=8, T=8192: step peak 23981 -> 10470 MiB, TRL 1.16 38279 MiB; time 1.02x the same step without offload).

    model = AutoModelForCausalLM.from_pretrained(...)   # or a PeftModel, or a DeepSpeed engine
    install_activation_offload(model)                   # checkpointing on, with our function
    loss = model(**batch).loss; loss.backward()
    remove_activation_offload(model)

Without an accelerator the same function keeps inputs where they are (plain reentrant checkpointing:
the no-op twin). `OffloadConfig(device_copies=True, use_streams=False, pin_memory=False)` forces the
real copy path on CPU for tests; `SavedActivationTracker` reports where the saved bytes live.
A row longer than `recompute_tokens` runs in sequence tiles, forward and re-run (tiling/layer.py): one 8K-token SmolLM2
row's re-run falls 5x in RSS with 512-token tiles; the same tiles bound one 110K-token Qwen3-8B row's re-run (33 GiB
whole). Layer inputs stay on the device up to `device_budget_bytes`, the host side is capped by `host_budget_bytes`
(HostMemoryError names the fix), reloads reuse two pooled buffers (residency.py).

Parts: config.py (OffloadConfig, from_settings), stash.py (host copies, double buffer), residency.py
(device / host budgets, buffer pool), checkpoint.py (the autograd function), replay.py (RNG / autocast replay),
rerun.py (whole and row-grouped re-run), sequence tiles: ../tiling/, install.py (on a
transformers model), saved_tensors.py (the head's saved tensors), tracker.py (where the saved bytes live).
Tests: `OMP_NUM_THREADS=1 pytest tests/test_offload.py tests/test_offload_tiled.py tests/test_offload_residency.py`.
"""

from grpo_accel.offload.checkpoint import OffloadedCheckpoint, OffloadedCheckpointFunction, offloaded_checkpoint  # noqa: F401 (tests patch)
from grpo_accel.offload.config import OffloadConfig
from grpo_accel.offload.install import install_activation_offload, remove_activation_offload
from grpo_accel.offload.saved_tensors import offload_saved_tensors
from grpo_accel.offload.stash import ActivationStash, StashEntry  # noqa: F401 (StashEntry: the trainer parity test patches it)
from grpo_accel.offload.tracker import SavedActivationTracker

__all__ = [
    "OffloadConfig", "ActivationStash", "OffloadedCheckpoint", "offloaded_checkpoint",
    "install_activation_offload", "remove_activation_offload", "offload_saved_tensors",
    "SavedActivationTracker",
]
