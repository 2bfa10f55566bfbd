"""GPU presets, one job a module: the table (`table`: the training side of each accelerate YAML, which are package
data here), GPU detection (`gpu`), and which preset a run uses (`launcher`: --preset, else the YAML that launched
this process, else the detected GPU's).

    accelerate launch --config_file accelerate_configs/h100_110k.yaml launch/train.py
    grpo-accel presets                                   # the table, with the planner's predicted peak
"""

from grpo_accel.app.presets.gpu import GPUProps, check_preset_fits_gpu, current_gpu_props, detect, detect_preset
from grpo_accel.app.presets.launcher import launching_yaml, preset_for_yaml, select_preset
from grpo_accel.app.presets.table import (
    CONFIG_DIR,
    DEMO_RECIPE,
    GPU_RECIPE,
    PRESETS,
    Preset,
    PresetError,
    get_preset,
    list_presets,
    preset_table_rows,
)

__all__ = ["CONFIG_DIR", "DEMO_RECIPE", "GPU_RECIPE", "GPUProps", "PRESETS", "Preset", "PresetError",
           "check_preset_fits_gpu", "current_gpu_props", "detect", "detect_preset", "get_preset", "launching_yaml",
           "list_presets", "preset_for_yaml", "preset_table_rows", "select_preset"]
