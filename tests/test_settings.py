"""The settings layer (core/settings.py): each of our settings defined once, and one resolved set of values that the
planner and the trainer both run with. Checked against the layers that read it, not against itself."""

import dataclasses
import inspect
import typing

import pytest
from trl import GRPOConfig

from grpo_accel.core.errors import ConfigError
from grpo_accel.core.settings import SETTINGS, RunSettings, offload_activations_on
from grpo_accel.core.units import GIB
from grpo_accel.planning.memory import plan_memory
from grpo_accel.planning.plan_inputs import PLANNED_SETTINGS
from grpo_accel.trainer.config import GRPOAccelConfig


def test_the_config_declares_exactly_the_registry():
    """GRPOAccelConfig's own fields are SETTINGS': a field added without an entry (or an entry without a field), a
    type, default or --help text that differs from its entry, fails here."""
    ours = [f for f in dataclasses.fields(GRPOAccelConfig) if f.name not in {g.name for g in dataclasses.fields(
        GRPOConfig)}]
    assert sorted(f.name for f in ours) == sorted(SETTINGS)
    hints = typing.get_type_hints(GRPOAccelConfig)
    for f in ours:
        spec = SETTINGS[f.name]
        assert hints[f.name] == spec.type, f.name
        assert f.default == spec.default and f.metadata["help"] == spec.help, f.name


def test_the_planner_takes_the_resolved_settings_by_their_names():
    plan_args = inspect.signature(plan_memory).parameters
    run_fields = {f.name for f in dataclasses.fields(RunSettings)}
    assert set(PLANNED_SETTINGS) <= set(plan_args) and set(PLANNED_SETTINGS) <= run_fields
    # the planner's defaults are a run that sets nothing, but for the two savers it prices off unless asked (the
    # bare step its docstring describes): offload ("auto" is on with CUDA) and the shared prompt
    defaults = RunSettings.resolve({}, cuda=True)
    for name in set(PLANNED_SETTINGS) - {"offload_activations", "share_prompt"}:
        assert plan_args[name].default == getattr(defaults, name), name


@pytest.mark.parametrize("setting,cuda,gc,expected", [
    ("auto", True, True, True), ("auto", True, False, False), ("auto", False, True, False), (True, False, True, True),
    (False, True, True, False), ("TRUE", False, False, True), ("false", True, True, False)])
def test_offload_activations_auto_rule(setting, cuda, gc, expected):
    assert offload_activations_on(setting, cuda, gc) is expected


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_offload_activations_rejects(bad):
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        offload_activations_on(bad, False, True)


def test_a_value_is_kept_as_the_flag_types_it():
    """A YAML's or a preset's True is the flag's "true"; a bad choice or number is one error line naming the flag."""
    assert GRPOAccelConfig("o", offload_activations=True, use_cpu=True).offload_activations == "true"
    assert GRPOAccelConfig("o", share_prompt="AUTO", use_cpu=True).share_prompt == "auto"
    with pytest.raises(ConfigError, match=r"--offload_activations yes is not one of auto, true, false\. Fix: "):
        GRPOAccelConfig("o", offload_activations="yes", use_cpu=True)
    with pytest.raises(ConfigError, match=r"--offload_recompute_tokens 0 must be ≥ 1\. Fix: "):
        GRPOAccelConfig("o", offload_recompute_tokens=0, use_cpu=True)
    with pytest.raises(ConfigError, match=r"--logprob_chunk_size 0 must be ≥ 1 \(or unset: automatic\)"):
        GRPOAccelConfig("o", logprob_chunk_size=0, use_cpu=True)


def test_one_setting_from_the_command_line_to_the_step(tmp_path):
    """The offload settings typed as flags (a string, GiB) reach the planner's inputs and the trainer's stash as the
    same values in the same units: what `grpo-accel plan` sizes is what the step runs."""
    from support.rewards import length_reward

    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.data.datasets import arithmetic_dataset
    from grpo_accel.data.models import load_model
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    spec = resolve_run_spec(["--preset", "cpu", "--offload_activations", "TRUE", "--gradient_checkpointing", "true",
                             "--offload_device_budget_gib", "0.25", "--offload_recompute_tokens", "512",
                             "--padding_free", "false", "--output_dir", str(tmp_path)])
    assert spec.config.offload_activations == "true" and spec.config.offload_device_budget_gib == 0.25
    planned = spec.plan().inputs
    assert (planned["offload_activations"], planned["offload_recompute_tokens"],
            planned["offload_device_budget_bytes"], planned["share_prompt"]) == (True, 512, GIB // 4, "false")
    model, tokenizer = load_model("tiny-llama")
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=spec.config, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 8))
    try:
        assert {k: getattr(trainer.settings, k) for k in PLANNED_SETTINGS} == {k: planned[k] for k in PLANNED_SETTINGS}
        stash = trainer.offload_config
        assert (stash.recompute_tokens, stash.device_budget_bytes) == (512, GIB // 4)
        assert trainer.share_prompt == "false"
    finally:
        trainer.close()


# What a preset alone knows, so names no flag: its machine (the accelerate YAML's processes and DeepSpeed settings, the
# GPU it targets), what it is, the named shape the planner reads offline, and the prompt budget the plan sizes
PRESET_ONLY = {"name", "description", "target_gpu", "min_gpu_mem_gib", "min_compute_capability", "num_processes",
               "architecture", "max_prompt_length", "deepspeed_stage", "offload_optimizer", "offload_params", "yaml",
               "recipe", "server_gpus"}


def test_a_preset_names_its_settings_as_the_flags_do():
    """Every other preset field is a flag of the same name (it was `dtype` for --model_dtype, a bool for
    --offload_activations), and each setting's value is as the flag types it."""
    from grpo_accel.app.presets.table import PRESETS, Preset
    from grpo_accel.app.run_spec import RunParser

    flags = {name[2:] for name in RunParser().flag_names()}
    assert {f.name for f in dataclasses.fields(Preset)} - flags == PRESET_ONLY
    for preset in PRESETS.values():
        for name in SETTINGS.keys() & {f.name for f in dataclasses.fields(Preset)}:
            assert SETTINGS[name].parse(getattr(preset, name)) == getattr(preset, name), (preset.name, name)
    with pytest.raises(ValueError, match="offload_activations=True, write it as the flag does"):
        dataclasses.replace(PRESETS["cpu"], offload_activations=True)


def test_each_auto_rule_names_a_function_that_exists():
    """A setting's `auto` names the function that decides it (a dotted path below grpo_accel, or a name in
    core/settings.py): renaming one without its entry fails here."""
    import importlib
    import re

    from grpo_accel.core import settings

    for spec in SETTINGS.values():
        for name in re.findall(r"[a-z_]+(?:\.[a-z_]+)+|[a-z]+_[a-z_]+", spec.auto):
            if "." in name:
                module, attr = name.rsplit(".", 1)
                assert hasattr(importlib.import_module(f"grpo_accel.{module}"), attr), (spec.name, name)
            else:
                assert hasattr(settings, name), (spec.name, name)
