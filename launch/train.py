"""GRPO training entry point.

    accelerate launch --config_file accelerate_configs/cpu.yaml launch/train.py            # the demo
    accelerate launch --config_file accelerate_configs/h100_110k.yaml launch/train.py --model Qwen/Qwen3-8B
    python launch/train.py --config my_run.yaml --max_steps 10                              # one process

Any GRPOConfig / GRPOAccelConfig field is a flag (`--learning_rate 1e-4`) or a key of `--config`.
Everything a run produces lands in `runs/<run_name>/`: the adapter, checkpoints, metrics.csv,
summary.json, reward_curve.png, resolved_config.json, held-out completions before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo_accel.models import DEFAULT_MODEL  # noqa: E402  (light import: no torch model code yet)


@dataclass
class ScriptArguments:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "Hub name, local directory, "
                       f"'{DEFAULT_MODEL}' (embedded, offline) or 'tiny-llama' / 'tiny-qwen2' (random, tests)."})
    model_dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32, bfloat16, float16."})
    dataset: str = field(default="arithmetic", metadata={"help": "'arithmetic' (built-in), a JSONL path with "
                         "question/answer rows, a directory with train.jsonl/test.jsonl, or a hub name."})
    dataset_level: int = field(default=1, metadata={"help": "Difficulty of the built-in arithmetic set (1-3)."})
    train_size: int = field(default=2000, metadata={"help": "Training prompts to draw."})
    eval_size: int = field(default=200, metadata={"help": "Held-out problems evaluated before and after; 0 = skip."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Greedy tokens per held-out answer."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate() call in evaluation."})
    rewards: str = field(default="correctness,format", metadata={"help": "Comma list of built-in rewards "
                         "(correctness, format) or importable 'module:function' reward functions."})
    quantization: str = field(default="none", metadata={"help": "'none' or '4bit' (QLoRA, needs bitsandbytes)."})
    preset: str | None = field(default=None, metadata={"help": "Preset name; wins over the launching YAML's."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; 0 = full fine-tuning."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma list or 'all-linear'."})


# The demo's training recipe (DESIGN.md: measured with plain TRL on 2 cores); presets and --config override it.
DEMO_DEFAULTS = dict(
    learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, num_generations=8,
    per_device_train_batch_size=16, gradient_accumulation_steps=1, max_completion_length=40,
    temperature=0.7, gradient_checkpointing=False, max_steps=60, logging_steps=1, save_steps=20,
    save_total_limit=2, report_to="none", bf16=False, seed=42, disable_tqdm=False,
)


def build_parser(defaults: dict):
    from trl import TrlParser

    from grpo_accel.config import GRPOAccelConfig

    parser = TrlParser((ScriptArguments, GRPOAccelConfig))
    parser.set_defaults(**defaults)
    return parser


def preparse(argv):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=None)
    pre.add_argument("--run_name", default=None)
    pre.add_argument("--model", default=DEFAULT_MODEL)
    pre.add_argument("--dataset", default="arithmetic")
    known, _ = pre.parse_known_args(argv)
    return known


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_run_name(model: str, dataset: str) -> str:
    short = lambda s: os.path.basename(os.path.normpath(s)).replace(".jsonl", "").lower()  # noqa: E731
    return f"{short(model)}-{short(dataset)}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    from grpo_accel.runner import choose_preset, main_guarded

    pre = preparse(argv)
    preset = main_guarded(choose_preset, pre.preset)
    if isinstance(preset, int):
        return preset
    model = pre.model if "--model" in " ".join(argv) else preset.model
    run_name = pre.run_name or default_run_name(model, pre.dataset)
    # Precedence: the demo recipe < the preset < --config file < command-line flags.
    defaults = dict(DEMO_DEFAULTS, **preset.training_overrides(), preset=preset.name, run_name=run_name,
                    output_dir=os.path.join("runs", run_name))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _cuda_available():
        # Several CPU processes (the cpu_zero* presets): without gloo forced, accelerate sees 1 process and
        # DeepSpeed 2, and the batch-size check fails.
        defaults["ddp_backend"] = "gloo"
        from grpo_accel.cpu_distributed import prepare_cpu_processes

        prepare_cpu_processes()
    parsed = main_guarded(lambda: build_parser(defaults).parse_args_and_config(args=argv))
    if isinstance(parsed, int):
        return parsed
    script_args, config = parsed

    from grpo_accel.runner import run

    return main_guarded(run, script_args, config)


if __name__ == "__main__":
    import faulthandler
    import signal

    # A run that seems stuck: `kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
