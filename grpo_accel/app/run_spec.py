"""One run, one spec: the preset, the `--config` YAML and the flags, resolved once.

    spec = resolve_run_spec(["--preset", "h100_110k", "--max_completion_length", "65536"])
    spec.script.model, spec.config.max_completion_length, spec.preset.name, spec.plan().peak_gib

`launch/train.py` and `grpo-accel plan` call `resolve_run_spec` with the same flags, so what `plan` prints is
what `train.py` would run. Precedence, lowest first: the preset (a complete override: training fields,
`model_init_kwargs`, LoRA; the CPU demo recipe belongs to the `cpu` preset alone) < the `--config` YAML < flags.
Field names are TRL's and transformers' (`GRPOAccelConfig`) plus `ScriptArguments` below; a `--config` key is
exactly a flag without its dashes. Everything a user can get wrong here raises `ConfigError` (one `error:` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from grpo_accel.core import dtypes
from grpo_accel.core.errors import ConfigError
from grpo_accel.core.processes import launched_processes
from grpo_accel.data.models import DEFAULT_MODEL


@dataclass
class ScriptArguments:
    """The run-level flags that are not GRPOConfig fields (model, data, rewards, LoRA, preset)."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "Hub id (Qwen/Qwen2.5-1.5B-Instruct), local "
                       f"directory, '{DEFAULT_MODEL}' (embedded, offline) or 'tiny-llama' / 'tiny-qwen2' (tests)."})
    model_dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32, bfloat16, float16 "
                             "(or fp32, bf16, fp16)."})
    dataset: str = field(default="arithmetic", metadata={"help": "'arithmetic' (built-in), or TRL's prompt "
                         "datasets: a file (.jsonl, .json, .parquet, .csv), a directory or a hub name whose rows have "
                         "a 'prompt' (text or chat messages; other columns go to the rewards as keyword arguments) "
                         "or 'question'/'answer' (GSM8K). A test/validation split is the held-out evaluation."})
    dataset_config: str | None = field(default=None, metadata={"help": "The hub dataset's configuration (e.g. "
                                       "'main' for openai/gsm8k)."})
    dataset_split: str = field(default="train", metadata={"help": "The split to train on."})
    system_prompt: str | None = field(default=None, metadata={"help": "A system message put first in every chat "
                                      "prompt; 'none' for none. Default: the arithmetic answer format for "
                                      "'arithmetic' and question/answer rows, nothing for prompt datasets."})
    dataset_level: int = field(default=1, metadata={"help": "Difficulty of the built-in arithmetic set (1-3)."})
    train_size: int = field(default=2000, metadata={"help": "Training prompts to draw."})
    eval_size: int = field(default=200, metadata={"help": "Held-out problems evaluated before and after; 0 = skip."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Greedy tokens per held-out answer."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate() call in evaluation."})
    rewards: str = field(default="correctness,format", metadata={"help": "Comma list of built-in rewards "
                         "(correctness, format), importable 'module:function' reward functions and reward models "
                         "(a local directory or org/name hub id of a sequence classifier); --reward_weights weighs "
                         "them in this order."})
    quantization: str = field(default="none", metadata={"help": "'none' or '4bit' (QLoRA, needs bitsandbytes)."})
    preset: str | None = field(default=None, metadata={"help": "Preset name; wins over the launching YAML's and "
                               "the detected GPU's (`grpo-accel presets` lists them)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; 0 = full fine-tuning."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (0 with lora_r > 0: 2 x lora_r)."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma list or 'all-linear'."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Delete an earlier run in output_dir and "
                                       "start afresh (without it, a directory that holds a run is refused)."})

    def __post_init__(self):
        dtype = dtypes.long_name(self.model_dtype)
        if dtype is None:
            raise ConfigError(f"--model_dtype {self.model_dtype} is not a dtype. Fix: float32, bfloat16 or float16 "
                              f"(fp32, bf16, fp16 work too).")
        self.model_dtype = dtype
        if self.quantization not in ("none", "4bit"):
            raise ConfigError(f"--quantization {self.quantization}: use none or 4bit.")
        _at_least(self, "lora_r", 0, "0 means full fine-tuning, 8-64 is usual for LoRA")
        _at_least(self, "lora_alpha", 0, "usually 2 x lora_r")
        _at_least(self, "train_size", 1)
        _at_least(self, "eval_size", 0, "0 skips the held-out evaluation")
        _at_least(self, "eval_max_new_tokens", 1)
        _at_least(self, "eval_batch_size", 1)
        if self.dataset_level not in (1, 2, 3):
            raise ConfigError(f"--dataset_level {self.dataset_level}: the built-in set has levels 1, 2 and 3.")
        if self.quantization == "4bit" and self.lora_r == 0:
            raise ConfigError("--quantization 4bit trains LoRA adapters only (QLoRA). Fix: --lora_r 16, or "
                              "--quantization none for full fine-tuning.")


def _at_least(obj, name: str, low: int, hint: str = "") -> None:
    value = getattr(obj, name)
    if value is not None and value < low:
        raise ConfigError(f"--{name} {value} must be ≥ {low}{f' ({hint})' if hint else ''}. Fix: pass "
                          f"--{name} {max(low, 1)} or more.")


class RunParser(HfArgumentParser):
    """HfArgumentParser over (ScriptArguments, GRPOAccelConfig) with `--config` in --help, no abbreviations
    (`--model` must not match `--model_dtype`), and one-line errors with a "did you mean"."""

    def __init__(self):
        from grpo_accel.trainer.config import GRPOAccelConfig

        super().__init__((ScriptArguments, GRPOAccelConfig), prog="launch/train.py", allow_abbrev=False,
                         description="GRPO training: any GRPOConfig / GRPOAccelConfig field or script flag below.")
        self.add_argument("--config", default=None, help="YAML file of flags without dashes (flags given on the "
                          "command line win); an `env:` mapping sets environment variables.")

    def error(self, message):  # argparse would print ~200 lines of usage and exit
        raise ConfigError(f"{message}. Fix: see `python launch/train.py --help`.")

    def flag_names(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def unknown(self, token: str, where: str = "") -> ConfigError:
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name if name.startswith("--") else f"--{name}", self.flag_names(), n=1)
        hint = f"; did you mean {close[0] if name.startswith('--') else close[0][2:]}?" if close else ""
        return ConfigError(f"unknown {'key' if where else 'flag'} {name}{where}{hint} Fix: `python launch/train.py "
                           f"--help` lists every flag.")

    def explicit(self, argv: list[str]) -> dict:
        """{dest: value} for the flags given in argv only (type-converted); unknown flags raise."""
        saved = {a.dest: a.default for a in self._actions}
        try:
            for a in self._actions:
                a.default = argparse.SUPPRESS
            namespace, rest = self.parse_known_args(argv)
        finally:
            for a in self._actions:
                a.default = saved[a.dest]
        if rest:
            raise self.unknown(next((t for t in rest if t.startswith("-")), rest[0]))
        return vars(namespace)

    def yaml_values(self, path: str) -> dict:
        """The --config file's values, checked and converted as the matching flag would convert them."""
        import yaml

        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except OSError as exc:
            raise ConfigError(f"--config {path}: {exc.strerror}. Fix: check the path.") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path} is not valid YAML: {' '.join(str(exc).split())}. Fix: correct it at "
                              f"that line (keys are flags without the dashes).") from exc
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path} must be a YAML mapping of flag: value (got {type(values).__name__}).")
        for key, value in dict(values.pop("env", None) or {}).items():
            os.environ[str(key)] = str(value)
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")}
        out = {}
        for key, value in values.items():
            if key not in actions:
                raise self.unknown(str(key), f" in --config {path}")
            out[key] = self._convert(actions[key], value, path)
        return out

    @staticmethod
    def _convert(action, value, path):
        """A YAML scalar goes through the flag's own type (argparse converts only string defaults)."""
        if isinstance(value, (dict, list)) or value is None or action.type is None:
            return value
        try:
            converted = action.type(str(value) if not isinstance(value, bool) else str(value).lower())
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            kind = getattr(action.type, "__name__", "value")
            raise ConfigError(f"--config {path}: {action.dest}: {value!r} is not a valid {kind}. Fix: correct that "
                              f"key in {path}.") from exc
        if action.choices and converted not in action.choices:
            raise ConfigError(f"--config {path}: {action.dest}: {value!r} is not one of {list(action.choices)}.")
        return converted

    def build(self, argv: list[str], defaults: dict):
        """(ScriptArguments, GRPOAccelConfig) from defaults + argv; a dataclass's own check becomes ConfigError."""
        self.set_defaults(**defaults)
        namespace, rest = self.parse_known_args(argv)
        if rest:
            raise self.unknown(rest[0])
        objs = []
        for dtype in self.dataclass_types:
            keys = {f.name for f in dataclasses.fields(dtype) if f.init}
            try:
                objs.append(dtype(**{k: v for k, v in vars(namespace).items() if k in keys}))
            except ConfigError:
                raise
            except ValueError as exc:  # TRL's / transformers' own config checks: still the user's input
                raise ConfigError(f"{exc} Fix: change that flag.") from exc
        return tuple(objs)


@dataclass
class RunSpec:
    script: ScriptArguments
    config: object  # GRPOAccelConfig
    preset: object  # presets.Preset
    preset_why: str
    explicit: dict  # what the user gave, by flag or --config key (after conversion)
    config_path: str | None = None

    def fields(self) -> dict:
        """Every resolved value by its flag name."""
        return {**dataclasses.asdict(self.script),
                **{f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}}

    @functools.cached_property
    def stack(self):
        """What generates on this machine (planning.routes.Stack: vLLM, vllm-bnb-plugin, CUDA); `grpo-accel plan`
        sets the machine it plans for (a GPU preset's CUDA, or `--stack pinned`)."""
        from grpo_accel.generation.vllm_setup import local_stack

        return local_stack()

    def route(self) -> tuple[str, str]:
        """(generation route, why) this run takes on its machine: the route the plan sizes."""
        return self.preset.route(self.fields(), self.stack)

    def plan(self, **overrides):
        """The planner's prediction for this run (one process): the preset's plan with this run's values, sizing
        the generation route this run takes (`route`)."""
        return self.preset.plan(self.fields(), self.stack, **overrides)  # an unreadable shape raises ConfigError

    def resolved(self) -> dict:
        """What resolved_config.json records: every field, the preset and why it was chosen."""
        return {"preset": self.preset.name, "preset_why": self.preset_why, "explicit": sorted(self.explicit),
                "script": dataclasses.asdict(self.script), "config": self.config.to_dict()}


def default_run_name(model: str, dataset: str) -> str:
    short = lambda s: os.path.basename(os.path.normpath(s)).replace(".jsonl", "").lower()  # noqa: E731
    return f"{short(model)}-{short(dataset)}"


def split_config_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv without --config PATH, PATH)."""
    out, path, it = [], None, iter(range(len(argv)))
    for i in it:
        tok = argv[i]
        if tok == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML path. Fix: --config my_run.yaml")
            path = argv[i + 1]
            next(it)
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
        else:
            out.append(tok)
    return out, path


def resolve_run_spec(argv: list[str], cmdline=None, gpu_props="current", for_plan: bool = False) -> RunSpec:
    """Parse argv (and its --config) over the chosen preset's values; see the module docstring.

    for_plan: resolving to plan a GPU preset on a machine without its GPU (`grpo-accel plan`, tests): the config
    is built with use_cpu so transformers' bf16 check passes; the planner reads the dtype from --model_dtype."""
    from grpo_accel.app import presets
    from grpo_accel.app.presets import select_preset

    parser = RunParser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    argv, config_path = split_config_flag(list(argv))
    from_yaml = parser.yaml_values(config_path) if config_path else {}
    from_flags = parser.explicit(argv)
    explicit = {**from_yaml, **from_flags}
    preset, why = select_preset(explicit.get("preset"), cmdline=cmdline, gpu_props=gpu_props)
    if not for_plan:  # before the config is built: a GPU preset on the wrong machine names the preset that fits
        presets.check_preset_fits_gpu(preset, gpu_props)
    if "preset" in from_yaml and "preset" not in from_flags:
        why = f"preset: {preset.name} in --config {config_path}"
    model = explicit.get("model", preset.training_overrides()["model"])
    run_name = explicit.get("run_name") or default_run_name(model, explicit.get("dataset", "arithmetic"))
    # launch/train.py stops on a blank or non-finite reward; the trainer's own default is TRL's behaviour
    defaults = {**preset.training_overrides(), "preset": preset.name, "run_name": run_name, "reward_checks": "strict",
                "max_nonfinite_steps": 3,
                "output_dir": os.path.join("runs", run_name), **from_yaml}
    if launched_processes() > 1 and not _cuda_available():
        defaults.update(cpu_processes_defaults(explicit))
    if for_plan and not _cuda_available():
        defaults["use_cpu"] = True
    script, config = RunParser().build(argv, defaults)
    return RunSpec(script, config, preset, why, explicit, config_path)


def cpu_processes_defaults(explicit: dict) -> dict:
    """Defaults for several processes on a machine without CUDA. Both engines need gloo forced, or accelerate sees
    1 process (and DeepSpeed 2). DeepSpeed (the cpu_zero* presets, launched with ACCELERATE_USE_DEEPSPEED) needs
    use_cpu false; torch DDP (a plain `accelerate launch` or torchrun of 2 processes) needs use_cpu true: accelerate
    1.15 gives LOCAL_RANK without CUDA and without `cpu` no distributed type, so DDP never wraps the model (with
    colocated vLLM the first step then failed: IndexError in TRL's shuffle_sequence_dict on rank 1)."""
    defaults = {"ddp_backend": "gloo"}
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or explicit.get("deepspeed")
    if not deepspeed:
        defaults["use_cpu"] = True
    return defaults


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


__all__ = ["RunParser", "RunSpec", "ScriptArguments", "cpu_processes_defaults", "default_run_name",
           "resolve_run_spec"]
