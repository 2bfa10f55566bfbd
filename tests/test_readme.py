"""The README's "Training on your GPU" section, checked as far as a CPU machine can: its commands parse and
plan, and what it says detection picks for GPUs outside the table is what detection picks.

    OMP_NUM_THREADS=1 pytest tests/test_readme.py
"""

import re
import shlex
from pathlib import Path

import pytest

from grpo_accel.app.cli import main
from grpo_accel.app.presets import GPUProps, detect_preset

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
GPU_SECTION = README[README.index("## Training on your GPU"):README.index("## When things go wrong")]
MIB = 1 << 20


def test_readme_plan_commands_run():
    commands = re.findall(r"^(grpo-accel plan [^#\n`]*)", GPU_SECTION, re.M)
    commands += re.findall(r"`(grpo-accel plan [^`]*)`", GPU_SECTION)
    assert len(commands) >= 2
    for command in commands:
        assert main(shlex.split(command)[1:]) in (0, 1), command  # fits or names the fix; never a usage error


def test_readme_launch_flags_are_flags():
    from grpo_accel.app.run_spec import RunParser

    flags = set(RunParser().flag_names())
    launch = GPU_SECTION[GPU_SECTION.index("accelerate launch"):].split("```")[0]
    for flag in re.findall(r"(--[a-z_]+)", launch.split("launch/train.py", 1)[1]):
        assert flag in flags, flag


@pytest.mark.parametrize("name, mib, cc, expected", [
    ("NVIDIA GeForce RTX 4090", 24564, (8, 9), "l4_24gb_qlora"),
    ("NVIDIA A10G", 23028, (8, 6), "l4_24gb_qlora"),
    ("NVIDIA L40S", 46068, (8, 9), "a100_40gb_lora"),
])
def test_detection_for_gpus_outside_the_table_is_what_the_readme_says(name, mib, cc, expected):
    assert detect_preset(GPUProps(name, mib * MIB, *cc)).name == expected
    short = name.replace("NVIDIA ", "").replace("GeForce ", "").split()[0]
    assert re.search(rf"{short}[^.]*`{expected}`", GPU_SECTION.replace("\n", " ")), (short, expected)
