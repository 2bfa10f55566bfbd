"""Which preset a run uses: --preset, else the YAML `accelerate launch --config_file` got (found from this
process's and its parents' command lines, since accelerate does not pass it on), else the detected GPU's."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_accel.app.presets import gpu
from grpo_accel.app.presets.table import PRESETS, Preset, get_preset


def preset_for_yaml(path) -> Preset | None:
    """The preset of an accelerate YAML, by file stem (None for a YAML that is not one of ours)."""
    return PRESETS.get(Path(str(path)).stem)


def _config_file_arg(argv: list[str]) -> str | None:
    for i, tok in enumerate(argv):
        if tok == "--config_file" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--config_file="):
            return tok.split("=", 1)[1]
    return None


def _read_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [t.decode(errors="replace") for t in f.read().split(b"\0") if t]


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return 0


def launching_yaml(cmdline=None, max_depth: int = 12) -> Path | None:
    """The `--config_file X.yaml` that `accelerate launch` got, from this process or its ancestors.

    cmdline: a command line to read instead (str or list, for tests). Otherwise walks /proc/<pid>/cmdline from
    this process up through its parents (accelerate -> torchrun / deepspeed launcher -> this script); a relative
    path is resolved against that process's working directory.
    """
    if cmdline is not None:
        argv = cmdline.split() if isinstance(cmdline, str) else list(cmdline)
        found = _config_file_arg(argv)
        return Path(found) if found else None
    pid = os.getpid()
    for _ in range(max_depth):
        if pid <= 1:
            break
        try:
            found = _config_file_arg(_read_cmdline(pid))
            if found:
                path = Path(found)
                if not path.is_absolute():
                    try:
                        path = Path(os.readlink(f"/proc/{pid}/cwd")) / path
                    except OSError:
                        pass
                return path
            pid = _parent_pid(pid)
        except OSError:  # not Linux, or a parent we may not read
            break
    return None


def select_preset(cli_preset: str | None = None, cmdline=None, gpu_props="current") -> tuple[Preset, str]:
    """(preset, why): --preset wins; else the launching YAML's preset; else the detected GPU's."""
    if cli_preset:
        return get_preset(cli_preset), f"--preset {cli_preset} on the command line"
    yaml_path = launching_yaml(cmdline)
    if yaml_path is not None:
        preset = preset_for_yaml(yaml_path)
        if preset is not None:
            return preset, f"launched with --config_file {yaml_path}"
    preset, why = gpu.detect(gpu.current_gpu_props() if gpu_props == "current" else gpu_props)
    if yaml_path is not None:
        why = f"{yaml_path.name} is not a grpo_accel preset YAML; {why}"
    return preset, why


__all__ = ["launching_yaml", "preset_for_yaml", "select_preset"]
