"""GPU detection: which preset fits the GPU here, and a clear refusal when the chosen one does not."""

from __future__ import annotations

import re
from dataclasses import dataclass

from grpo_accel.app.presets.table import PRESETS, Preset, PresetError, get_preset
from grpo_accel.core.units import GIB


@dataclass(frozen=True)
class GPUProps:
    """What detection reads from torch.cuda.get_device_properties(0) (injectable so tests can fake GPUs)."""

    name: str
    total_memory: int  # bytes
    major: int
    minor: int
    count: int = 1

    @property
    def mem_gib(self) -> float:
        return self.total_memory / GIB


def current_gpu_props() -> GPUProps | None:
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        p = torch.cuda.get_device_properties(0)
        return GPUProps(p.name, p.total_memory, p.major, p.minor, torch.cuda.device_count())
    except Exception:
        return None


def _props(gpu) -> GPUProps | None:
    if gpu is None or getattr(gpu, "count", 1) == 0:
        return None
    if isinstance(gpu, GPUProps):
        return gpu
    return GPUProps(gpu.name, int(gpu.total_memory), int(gpu.major), int(gpu.minor), int(getattr(gpu, "count", 1)))


def _describe(gpu: GPUProps) -> str:
    many = f"{gpu.count}x " if gpu.count > 1 else ""
    return f"{many}{gpu.name} ({gpu.mem_gib:.1f} GiB, sm{gpu.major}{gpu.minor})"


def _gpu_model(text: str) -> str | None:
    """'t4', 'l4', 'a100', 'h100', 'h200', 'b200' from a device name ('NVIDIA GH200' is none of them)."""
    found = re.findall(r"\b([abhlt]\d{1,3})\b", text.lower())
    return found[0] if found else None


def detect(gpu) -> tuple[Preset, str]:
    """(preset, why) for a GPU (GPUProps or torch's properties; None: the cpu preset)."""
    gpu = _props(gpu)
    if gpu is None:
        return PRESETS["cpu"], "no CUDA GPU found: cpu"
    cc = (gpu.major, gpu.minor)
    ok = [p for p in PRESETS.values()
          if p.is_gpu and p.min_gpu_mem_gib <= gpu.mem_gib and tuple(p.min_compute_capability) <= cc
          and p.num_processes <= gpu.count and p.name != "multinode_zero3"]
    if not ok:
        smallest = min((p for p in PRESETS.values() if p.is_gpu), key=lambda p: p.min_gpu_mem_gib)
        sm = "".join(map(str, smallest.min_compute_capability))
        return PRESETS["cpu"], (f"{_describe(gpu)} is below every GPU preset (smallest: {smallest.name}, "
                                f"≥ {smallest.min_gpu_mem_gib:g} GiB, sm{sm}+): cpu")
    model = _gpu_model(gpu.name)
    # most processes used, then most memory, then the preset made for this GPU model (A100 vs H100 at 80 GB)
    best = max(ok, key=lambda p: (p.num_processes, p.min_gpu_mem_gib,
                                  model is not None and _gpu_model(p.target_gpu) == model))
    return best, f"detected {_describe(gpu)}: {best.name}"


def detect_preset(gpu_props="current") -> Preset:
    """The preset for a GPU (props: name, total_memory bytes, major, minor, count); None or no GPU -> cpu."""
    return detect(current_gpu_props() if gpu_props == "current" else gpu_props)[0]


def check_preset_fits_gpu(preset: Preset | str, gpu_props="current") -> None:
    """Raise PresetError naming a preset that fits, before any weights load."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    gpu = _props(current_gpu_props() if gpu_props == "current" else gpu_props)
    if not preset.is_gpu:
        return
    if gpu is None:
        raise PresetError(f"preset {preset.name} needs a CUDA GPU ({preset.target_gpu}); none found: try cpu")
    suggestion = detect(gpu)[0].name
    if gpu.mem_gib < preset.min_gpu_mem_gib:
        raise PresetError(f"preset {preset.name} needs ≥ {preset.min_gpu_mem_gib:g} GiB of GPU memory, this GPU "
                          f"({gpu.name}) has {gpu.mem_gib:.0f} GiB: try {suggestion}")
    if (gpu.major, gpu.minor) < tuple(preset.min_compute_capability):
        need = ".".join(map(str, preset.min_compute_capability))
        why = "bf16 needs compute capability ≥ 8.0" if preset.model_dtype == "bf16" else f"it needs sm ≥ {need}"
        raise PresetError(f"preset {preset.name} trains in {preset.model_dtype}: {why}, this GPU ({gpu.name}) is "
                          f"{gpu.major}.{gpu.minor}: try {suggestion}")
    if gpu.count < preset.num_processes and preset.name != "multinode_zero3":
        raise PresetError(f"preset {preset.name} runs {preset.num_processes} processes, one per GPU; this machine "
                          f"has {gpu.count}: try {suggestion}")


__all__ = ["GPUProps", "check_preset_fits_gpu", "current_gpu_props", "detect", "detect_preset"]
