"""Per-phase memory telemetry for a GRPO step: where did the memory go, without a profiler.

Phases: generation, logps_no_grad (old / reference log-probs), policy_forward, backward, optimizer_step.
Each logged step gets `memory/<phase>_peak_gib` (CUDA: max_memory_allocated; CPU: peak RSS of the
process), `memory/host_rss_gib` and `time/<phase>_s` (wall seconds), in the tracker (wandb) and the run's
metrics.csv.
Cost: one counter reset + read per phase (CPU: a write to /proc/self/clear_refs), negligible per step.
"""

from __future__ import annotations

from transformers import TrainerCallback

from grpo_accel.core.phase_memory import PhaseMemory, rss_bytes
from grpo_accel.core.units import GIB


class PhaseTelemetry:
    def __init__(self):
        self.memory = PhaseMemory()
        self._open = None

    def phase(self, name: str):
        return self.memory.phase(name)

    def wrap_backward(self, accelerator) -> None:
        """accelerator.backward is where the Trainer runs every backward: time it as its own phase."""
        backward = accelerator.backward

        def backward_with_phase(loss, **kwargs):
            with self.phase("backward"):
                return backward(loss, **kwargs)

        accelerator.backward = backward_with_phase

    def callback(self) -> TrainerCallback:
        telemetry = self

        class OptimizerPhase(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                telemetry._open = telemetry.phase("optimizer_step")
                telemetry._open.__enter__()

            def on_optimizer_step(self, args, state, control, **kwargs):
                if telemetry._open is not None:
                    telemetry._open.__exit__(None, None, None)
                    telemetry._open = None

        return OptimizerPhase()

    def pop_metrics(self) -> dict[str, float]:
        """Peaks since the last log, then forget them (each logged step reports its own phases)."""
        metrics = self.memory.metrics()
        metrics["memory/host_rss_gib"] = round(rss_bytes() / GIB, 3)
        # wall seconds per phase, summed since the last log: the step's split (generation returns its tokens to the
        # host, so its time is whole; a CUDA phase without a sync ends when its kernels are queued)
        for r in self.memory.records:
            metrics[f"time/{r.name}_s"] = round(metrics.get(f"time/{r.name}_s", 0.0) + r.seconds, 3)
        self.memory.records.clear()
        return metrics
