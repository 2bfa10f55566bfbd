"""Presets: every YAML loads with accelerate's own loader and launch path, DeepSpeed sections validate with
DeepSpeed's own config class, presets and YAMLs match one to one, and preset selection.

    OMP_NUM_THREADS=1 pytest tests/test_presets.py
"""

import copy
import os
import re
from pathlib import Path
from unittest import mock

import pytest

from grpo_accel.app.presets import (
    CONFIG_DIR,
    PRESETS,
    GPUProps,
    PresetError,
    check_preset_fits_gpu,
    detect_preset,
    get_preset,
    launching_yaml,
    list_presets,
    preset_for_yaml,
    select_preset,
)

GIB_BYTES = 1 << 30
# total_memory as torch reports it for each card (bytes); names as torch.cuda.get_device_properties gives them
FAKE_GPUS = {
    "T4": GPUProps("Tesla T4", int(14.58 * GIB_BYTES), 7, 5),
    "L4": GPUProps("NVIDIA L4", int(22.05 * GIB_BYTES), 8, 9),
    "A100-40": GPUProps("NVIDIA A100-SXM4-40GB", int(39.39 * GIB_BYTES), 8, 0),
    "A100-80": GPUProps("NVIDIA A100-SXM4-80GB", int(79.15 * GIB_BYTES), 8, 0),
    "H100": GPUProps("NVIDIA H100 80GB HBM3", int(79.11 * GIB_BYTES), 9, 0),
    "H200": GPUProps("NVIDIA H200", int(139.8 * GIB_BYTES), 9, 0),
    "B200": GPUProps("NVIDIA B200", int(178.4 * GIB_BYTES), 10, 0),
    "8xH100": GPUProps("NVIDIA H100 80GB HBM3", int(79.11 * GIB_BYTES), 9, 0, count=8),
}
EXPECTED = {"T4": "t4_qlora", "L4": "l4_24gb_qlora", "A100-40": "a100_40gb_lora", "A100-80": "a100_80gb_bf16",
            "H100": "h100_110k", "H200": "h200_200k", "B200": "b200_380k", "8xH100": "8xh100_zero2"}
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def test_every_preset_has_a_yaml_and_every_yaml_a_preset():
    yamls = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert yamls == {p.yaml for p in list_presets()}
    for p in list_presets():
        assert p.yaml == f"{p.name}.yaml" and preset_for_yaml(p.yaml_path) is p


@pytest.mark.parametrize("name", list(PRESETS))
def test_yaml_loads_with_accelerate_and_matches_preset(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    preset = get_preset(name)
    text = preset.yaml_path.read_text()
    launch = f"accelerate launch --config_file accelerate_configs/{preset.yaml} launch/train.py"
    assert text.startswith("# ") and launch in text
    cfg = load_config_from_file(str(preset.yaml_path))  # raises on unknown keys
    assert isinstance(cfg, ClusterConfig)
    assert cfg.num_processes == preset.num_processes
    assert cfg.mixed_precision == MIXED_PRECISION[preset.model_dtype]
    assert str(cfg.distributed_type.value) == ("DEEPSPEED" if preset.deepspeed_stage else "NO")
    if preset.deepspeed_stage:
        ds = cfg.deepspeed_config
        assert ds["zero_stage"] == preset.deepspeed_stage
        assert ds["offload_optimizer_device"] == ("cpu" if preset.offload_optimizer else "none")
        assert ds["offload_param_device"] == ("cpu" if preset.offload_params else "none")
    if not preset.is_gpu and preset.num_processes > 1:
        assert cfg.use_cpu is False  # DESIGN.md: with use_cpu true accelerate sees 1 process, DeepSpeed 2
    # the predicted peak quoted in the header is the planner's current one (stale docs fail here)
    quoted = float(re.search(r"predicts a peak of ([0-9.]+) GiB", text).group(1))
    assert quoted == pytest.approx(preset.plan().peak_gib, abs=0.051)


def _launch_env(yaml_path):
    """The environment `accelerate launch --config_file yaml_path` gives the script, via accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "launch/train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    return args, defaults, env


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.deepspeed_stage])
def test_deepspeed_section_validates_with_deepspeed(name, monkeypatch):
    import deepspeed.runtime.config as ds_config
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DeepSpeedPlugin

    preset = get_preset(name)
    args, defaults, env = _launch_env(preset.yaml_path)
    # every deepspeed_config key is a flag accelerate launch knows (unknown ones would be dropped silently)
    known = {a.dest for a in launch_command_parser()._actions}
    assert set(defaults.deepspeed_config) <= known
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # reads the env like the launched script does
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    config = copy.deepcopy(plugin.deepspeed_config)
    # fill "auto" as the HF Trainer does, with the preset's batch sizes
    world = preset.num_processes
    fill = dict(train_micro_batch_size_per_gpu=preset.per_device_train_batch_size,
                gradient_accumulation_steps=preset.gradient_accumulation_steps, gradient_clipping=1.0,
                train_batch_size=preset.per_device_train_batch_size * preset.gradient_accumulation_steps * world)
    for key, value in fill.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
    assert "auto" not in str(config)
    with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
            mock.patch.object(ds_config.dist, "get_world_size", return_value=world):
        ds = ds_config.DeepSpeedConfig(config)
    assert ds.world_size == world and ds.zero_optimization_stage == preset.deepspeed_stage
    device = lambda section: str(getattr(section.device, "value", section.device))  # noqa: E731 (enum or str)
    assert device(ds.zero_config.offload_optimizer) == ("cpu" if preset.offload_optimizer else "none")
    assert device(ds.zero_config.offload_param) == ("cpu" if preset.offload_params else "none")
    assert ds.bfloat16_config.enabled == (preset.model_dtype == "bf16")
    assert ds.train_batch_size == fill["train_batch_size"]


def test_deepspeed_config_class_rejects_a_bad_batch():  # the validation above can fail
    import deepspeed.runtime.config as ds_config

    bad = {"train_batch_size": 15, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 3}}
    with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
            mock.patch.object(ds_config.dist, "get_world_size", return_value=8), pytest.raises(AssertionError):
        ds_config.DeepSpeedConfig(bad)


@pytest.mark.parametrize("gpu", list(FAKE_GPUS))
def test_detect_preset_from_fake_gpus(gpu):
    props = FAKE_GPUS[gpu]
    preset = detect_preset(props)
    assert preset.name == EXPECTED[gpu]
    check_preset_fits_gpu(preset, props)  # the detected preset passes the check it will face


def test_detect_without_gpu_is_cpu():
    assert detect_preset(None).name == "cpu"
    assert detect_preset(GPUProps("none", 0, 0, 0, count=0)).name == "cpu"
    small = GPUProps("NVIDIA GeForce GTX 1080", 8 * GIB_BYTES, 6, 1)
    preset, why = select_preset(None, cmdline=[], gpu_props=small)
    assert preset.name == "cpu" and "below every GPU preset" in why


def test_t4_never_gets_a_bf16_preset():
    t4 = FAKE_GPUS["T4"]
    assert detect_preset(t4).model_dtype == "fp16"
    big_t4 = GPUProps("Tesla T4 (imaginary 80GB)", 80 * GIB_BYTES, 7, 5)  # memory alone must not pick bf16
    assert detect_preset(big_t4).model_dtype == "fp16"
    with pytest.raises(PresetError, match=r"bf16 needs compute capability ≥ 8.0.*try t4_qlora"):
        check_preset_fits_gpu("a100_40gb_lora", big_t4)


def test_too_small_gpu_gives_clear_error():
    with pytest.raises(PresetError) as err:
        check_preset_fits_gpu("h100_110k", FAKE_GPUS["L4"])
    assert str(err.value) == ("preset h100_110k needs ≥ 75 GiB of GPU memory, this GPU (NVIDIA L4) has 22 GiB: "
                              "try l4_24gb_qlora")
    with pytest.raises(PresetError, match="needs a CUDA GPU.*try cpu"):
        check_preset_fits_gpu("t4_qlora", None)
    with pytest.raises(PresetError, match="runs 8 processes.*has 1: try h100_110k"):
        check_preset_fits_gpu("8xh100_zero3", FAKE_GPUS["H100"])
    check_preset_fits_gpu("cpu", FAKE_GPUS["H100"])  # CPU presets run anywhere


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(PresetError, match="valid presets: cpu, cpu_zero2"):
        get_preset("h100")


def test_launching_yaml_from_command_lines():
    argv = ["/usr/bin/python", "/venv/bin/accelerate", "launch", "--config_file", "accelerate_configs/t4_qlora.yaml",
            "launch/train.py", "--max_steps", "3"]
    assert launching_yaml(argv).name == "t4_qlora.yaml"
    assert launching_yaml("accelerate launch --config_file=/x/cpu_zero3.yaml launch/train.py").name == "cpu_zero3.yaml"
    assert launching_yaml(["python", "launch/train.py", "--config", "run.yaml"]) is None  # the script's own --config


def test_preset_flag_wins_then_yaml_then_gpu():
    cmd = "accelerate launch --config_file accelerate_configs/l4_24gb_qlora.yaml launch/train.py"
    preset, why = select_preset("h200_200k", cmdline=cmd, gpu_props=FAKE_GPUS["T4"])
    assert preset.name == "h200_200k" and "--preset" in why
    preset, why = select_preset(None, cmdline=cmd, gpu_props=FAKE_GPUS["H100"])
    assert preset.name == "l4_24gb_qlora" and "l4_24gb_qlora.yaml" in why
    preset, why = select_preset(None, cmdline="python launch/train.py", gpu_props=FAKE_GPUS["H100"])
    assert preset.name == "h100_110k" and why.startswith("detected NVIDIA H100")
    preset, why = select_preset(None, cmdline="accelerate launch --config_file mine.yaml x.py", gpu_props=None)
    assert preset.name == "cpu" and "mine.yaml is not a grpo_accel preset YAML" in why


def test_launching_yaml_walks_the_real_parent_processes(tmp_path):
    """A child started by a process whose command line has --config_file finds it through /proc."""
    import subprocess
    import sys

    if not os.path.exists("/proc/self/cmdline"):
        pytest.skip("needs /proc")
    repo = str(Path(__file__).resolve().parents[1])  # the checkout: its accelerate_configs links to CONFIG_DIR
    child = (f"import sys; sys.path.insert(0, {repo!r}); from grpo_accel.app.presets import select_preset; "
             "p, why = select_preset(None, gpu_props=None); print(p.name, '|', why)")
    # the parent: a python process with `--config_file ...cpu_zero2.yaml` in its argv, like accelerate launch
    parent = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[3]]))"
    out = subprocess.run([sys.executable, "-c", parent, "--config_file", "accelerate_configs/cpu_zero2.yaml", child],
                         cwd=repo, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name, why = out.stdout.strip().split(" | ")
    assert name == "cpu_zero2" and why == f"launched with --config_file {repo}/accelerate_configs/cpu_zero2.yaml"


def test_lora_rank_on_a_full_finetuning_preset_gets_a_working_alpha(capsys):
    """cpu_zero2 is full fine-tuning (lora_alpha 0); `--lora_r 16` on it once kept alpha 0, which scales the
    adapter to nothing: zero gradients and a run that never learns. It must get alpha 2r."""
    import types

    from grpo_accel.app.presets import get_preset
    from grpo_accel.app.runner import lora_config, settle_lora_alpha

    assert get_preset("cpu_zero2").lora_alpha == 0
    args = types.SimpleNamespace(lora_r=16, lora_alpha=get_preset("cpu_zero2").lora_alpha,
                                 lora_target_modules="all-linear")
    settle_lora_alpha(args)
    assert lora_config(args).lora_alpha == 32
    assert "using lora_alpha 32" in capsys.readouterr().out
    kept = types.SimpleNamespace(lora_r=8, lora_alpha=8, lora_target_modules="all-linear")
    settle_lora_alpha(kept)
    assert kept.lora_alpha == 8


def test_gpt_oss_presets_plan_their_lengths():
    """b200_380k trains gpt-oss-20b at Unsloth's 380K; the H200 preset's length is the planner's longest on 130 GiB
    of GPU and 115 GiB of host, capped by its rope's 524,288 positions less the prompt (>= 380K, the goal)."""
    from grpo_accel.app.presets.table import H200_GPT_OSS_COMPLETION, H200_GPT_OSS_PLAN
    from grpo_accel.app.startup_checks import context_tokens
    from grpo_accel.planning.architectures import get_architecture
    from grpo_accel.planning.fitting import find_max_completion_length
    from grpo_accel.planning.memory import GIB

    b200, h200 = get_preset("b200_380k"), get_preset("h200_gpt_oss_512k")
    assert b200.architecture == h200.architecture == "gpt-oss-20b" and b200.max_completion_length == 380_000
    c = H200_GPT_OSS_PLAN
    longest, _ = find_max_completion_length(h200.plan(), c["gpu_gib"] * GIB, c["host_gib"] * GIB, step=c["step"])
    config = get_architecture("gpt-oss-20b")
    config.rope_parameters = h200.model_init_kwargs["rope_parameters"]
    cap = context_tokens(config) - h200.max_prompt_length
    assert H200_GPT_OSS_COMPLETION == min(longest, cap) >= 380_000
    assert h200.recipe["router_aux_loss_coef"] == 0.0  # offload refuses the router loss (tests/test_moe.py)
