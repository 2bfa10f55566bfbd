"""Several training processes on one machine without a GPU (the cpu_zero* presets: DeepSpeed over gloo).

Two things in the default stack can stall such a run forever instead of failing:
- DeepSpeed's CPU backend builds and initializes its shared-memory all-reduce op (`deepspeed_shm_comm`) in every
  process. Its start-up spin-waits, with no timeout, for every peer's /dev/shm segment; a peer that never makes
  one (killed mid-build, a sandbox whose /dev/shm misbehaves) leaves the others spinning at 100% CPU. ZeRO
  training never uses the op (only DeepSpeed inference's `inference_all_reduce` does; ZeRO's collectives go
  through torch.distributed/gloo), so we skip it: no spin, no C++ build (~35 s and a compiler on first use).
- gloo picks its network interface from the hostname; where the hostname resolves to an address the sandbox does
  not route, the processes wait on each other until gloo's 30-minute timeout. On one machine loopback is right.

Upstream: DeepSpeed >= 0.16 (its `deepspeed.comm.torch.build_shm_op` hook; the spin-wait has no timeout in the
versions pinned here) and torch 2.13's gloo interface choice. Remove the first when DeepSpeed's CPU backend skips
or times out the shm op for training; the second is a property of the sandbox, kept as the safe default for
single-machine CPU runs (GLOO_SOCKET_IFNAME set by the user wins). tests/test_cpu_distributed.py checks both.
"""

from __future__ import annotations

import os

from grpo_accel.core.console import log

LOOPBACK = "lo"


def prepare_cpu_processes() -> None:
    """Call before DeepSpeed/accelerate initialize the process group. Costs nothing a CPU ZeRO run uses."""
    if os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE")) == os.environ.get("WORLD_SIZE"):
        # Every process is on this machine: the user's choice (GLOO_SOCKET_IFNAME set) wins.
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists(f"/sys/class/net/{LOOPBACK}"):
            os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
    skip_deepspeed_shm_op()


def skip_deepspeed_shm_op() -> bool:
    """DeepSpeed's TorchBackend builds the shm op through `deepspeed.comm.torch.build_shm_op`; with it returning
    None the backend uses plain torch.distributed, as it does wherever the op cannot be built. True if skipped."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return False
    # Not `import deepspeed.comm.torch as m`: that binds deepspeed.comm's attribute `torch`, which is torch itself.
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    if not hasattr(ds_torch, "build_shm_op"):  # a DeepSpeed without the hook: nothing to skip
        return False
    ds_torch.build_shm_op = lambda: None
    log("DeepSpeed shared-memory all-reduce op skipped (CPU ZeRO training uses gloo's collectives)")
    return True
