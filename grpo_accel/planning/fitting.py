"""Searches over plans (planning.memory): what fits a GPU and a host. Each replans with one input changed and relies
on the peak growing with it.

    longest, plan = find_max_completion_length(PRESETS["h100_110k"].plan(), 80 * GIB, 128 * GIB)
    seqs = paged_sequences(plan, 80 * GIB)      # continuous batching: full-length sequences in flight at once
    plan = fit_host(plan, host_bytes)           # offloaded layer inputs the host cannot hold stay on the device
"""

from __future__ import annotations

from grpo_accel.planning.memory import MemoryPlan, plan_memory


def fit_host(plan: MemoryPlan, host_bytes: int | None) -> MemoryPlan:
    """`plan` with its offloaded layer inputs fitted to `host_bytes` of host memory: what the host cannot hold stays
    on the device (offload_device_budget_bytes, whole layer inputs), the rest goes to host. Unchanged when it fits."""
    inp = plan.inputs
    over = sum(plan.host.values()) - host_bytes if host_bytes is not None else 0
    if over <= 0 or not (inp["offload_activations"] and inp["gradient_checkpointing"]):
        return plan
    layer_input = (plan.device["activations_checkpointed"] + plan.host["activations_offloaded"]) // (
        plan.shape.layers + 1)  # checkpointing keeps L layer inputs and the head's, all [B, T, H]
    budget = -(-over // layer_input) * layer_input + inp["offload_device_budget_bytes"]
    return plan.replan(offload_device_budget_bytes=budget)


def paged_sequences(plan: MemoryPlan, gpu_bytes: int) -> int:
    """Full-length sequences continuous batching holds at once on `gpu_bytes` (0: not one fits): the most, up to the
    generation batch, whose page pool and working set fit beside what the step keeps while generating (weights,
    optimizer states; the training transients are freed by then). The rest wait in its queue."""
    inp = plan.inputs
    if inp["generation"] != "continuous_batching":
        raise ValueError(f"paged_sequences: the plan's route is {inp['generation']}, not continuous_batching")
    args = {k: v for k, v in inp.items() if k != "paged_seqs"}
    lo, hi = 0, int(inp["generation_batch"])
    while lo < hi:  # the peak grows with the sequences in flight: bisect
        mid = (lo + hi + 1) // 2
        if plan_memory(plan.shape, **args, paged_seqs=mid).peak_bytes <= gpu_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_max_completion_length(plan: MemoryPlan, gpu_bytes: int, host_bytes: int | None = None, step: int = 128,
                               limit: int = 1 << 22) -> tuple[int, MemoryPlan | None]:
    """(longest max_completion_length, a multiple of `step`, whose plan fits `gpu_bytes` on the device and
    `host_bytes` of host memory (None: unchecked), that plan) or (0, None). Layer inputs the host cannot hold stay
    on the device (`fit_host`). Doubling from `step`, then bisection: the peak grows with the length."""
    def fitted(t):
        p = fit_host(plan.replan(max_completion_length=t), host_bytes)
        ok = p.peak_bytes <= gpu_bytes and (host_bytes is None or sum(p.host.values()) <= host_bytes)
        return p if ok else None

    lo, hi = 0, step
    while hi <= limit and fitted(hi) is not None:
        lo, hi = hi, hi * 2
    if lo == 0:
        return 0, None
    hi = min(hi, limit + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fitted(mid) is not None else (lo, mid)
    return lo, fitted(lo)


__all__ = ["find_max_completion_length", "fit_host", "paged_sequences"]
