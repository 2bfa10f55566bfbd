"""`grpo-accel` command: presets, plan, report.

    grpo-accel presets                                        # the preset table with predicted peaks
    grpo-accel plan --preset h100_110k                        # breakdown + verdict; exit 1 when it does not fit
    grpo-accel plan --preset l4_24gb_qlora --max-completion-length 32768 --gpu-mem-gib 22
    grpo-accel plan --preset a100_80gb_bf16 --model ./my_model_dir   # any config.json / named architecture
    grpo-accel report runs/demo                               # PNGs of a finished or crashed run
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .memory import GIB, kv_cache_sequences, vllm_memory_fraction


def _table(rows: list[dict], headers: dict) -> str:
    cols = list(headers)
    cells = [[str(headers[c]) for c in cols]] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    numeric = [all(r[c] is not None and isinstance(r[c], (int, float)) for r in rows) for c in cols]
    out = []
    for row in cells:
        out.append("  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric)).rstrip())
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def cmd_presets(args) -> int:
    from .presets import preset_table_rows

    headers = dict(name="preset", gpu="GPU", model="model", precision="precision", lora_r="LoRA r",
                   completion="completion", generations="G", peak_gib="peak GiB", yaml="accelerate YAML")
    print(_table(preset_table_rows(), headers))
    print("\npeak GiB: the planner's prediction per GPU (host RAM for the cpu presets); "
          "`grpo-accel plan --preset NAME` for the breakdown.")
    return 0


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="start from this preset (default: the detected GPU's)")
    p.add_argument("--model", default=None, help="named architecture, local dir with config.json, or hub name")
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--max-prompt-length", type=int)
    p.add_argument("--num-generations", type=int)
    p.add_argument("--per-device-batch", type=int, help="sequences per forward/backward")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--quantization", choices=["none", "4bit"])
    p.add_argument("--lora-r", type=int, help="0 = full fine-tune")
    p.add_argument("--logprob-impl", choices=["naive", "trl", "chunked", "triton", "auto"])
    p.add_argument("--logprob-chunk-tokens", type=int)
    p.add_argument("--offload-activations", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--use-vllm", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--vllm-shares-weights", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--vllm-sleep", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--gpu-mem-gib", type=float, help="GPU memory to plan for (default: this GPU, else the preset's "
                   "minimum)")


_PLAN_KEYS = ("max_completion_length", "max_prompt_length", "num_generations", "per_device_batch", "dtype",
              "quantization", "lora_r", "logprob_impl", "logprob_chunk_tokens", "offload_activations",
              "gradient_checkpointing", "use_vllm", "vllm_shares_weights", "vllm_sleep")


def cmd_plan(args) -> int:
    from .architectures import model_shape
    from .presets import current_gpu_props, detect_preset, get_preset

    gpu = current_gpu_props()
    preset = get_preset(args.preset) if args.preset else detect_preset(gpu)
    overrides = {k: getattr(args, k) for k in _PLAN_KEYS if getattr(args, k) is not None}
    shape = model_shape(args.model or preset.architecture)
    plan = preset.plan(shape=shape, **overrides)
    if args.gpu_mem_gib is not None:
        gpu_bytes, where = int(args.gpu_mem_gib * GIB), "--gpu-mem-gib"
    elif gpu is not None and preset.is_gpu:
        gpu_bytes, where = gpu.total_memory, gpu.name
    else:
        gpu_bytes, where = int(preset.min_gpu_mem_gib * GIB), f"{preset.name}'s minimum"
    inp = plan.inputs
    print(f"preset {preset.name}, model {shape.name} ({shape.n_params / 1e9:.2f}B params, L={shape.layers} "
          f"H={shape.hidden} V={shape.vocab}), {inp['dtype']}{'+nf4' if inp['quantization'] == '4bit' else ''}, "
          f"LoRA r={inp['lora_r'] or 'full'}, {inp['per_device_batch']} x ({inp['max_prompt_length']} + "
          f"{inp['max_completion_length']}) tokens, G={inp['num_generations']}")
    print(plan.format())
    if not preset.is_gpu and args.gpu_mem_gib is None:
        print("CPU preset: the peak is host RAM beyond the Python interpreter; no GPU verdict.")
        return 0
    verdict = plan.verdict(gpu_bytes)
    print(f"GPU memory: {gpu_bytes / GIB:.1f} GiB ({where})")
    print(verdict)
    if verdict.fits and inp["use_vllm"]:
        frac = vllm_memory_fraction(plan, gpu_bytes)
        print(f"vLLM gpu_memory_utilization {frac:.3f}: KV cache for {kv_cache_sequences(plan, gpu_bytes)} "
              f"full-length sequences at once (of {inp['num_generations']} per prompt)")
    return 0 if verdict.fits else 1


# subcommand -> (help, add_arguments, handler); train / report register here
def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory, e.g. runs/demo")


def cmd_report(args) -> int:
    from .report import render_report

    for path in render_report(args.run_dir):
        print(path)
    return 0


COMMANDS: dict[str, tuple[str, Callable | None, Callable]] = {
    "presets": ("list the GPU presets with the planner's predicted peak", None, cmd_presets),
    "plan": ("predict the memory of a preset (and overrides); exit 1 when it does not fit", add_plan_args, cmd_plan),
    "report": ("render a run's PNGs (reward, rewards, completion length, memory per phase)", add_report_args,
               cmd_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-accel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, handler) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if add_args:
            add_args(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, KeyError, FileNotFoundError) as exc:  # named-fix errors from presets / architectures
        print(f"grpo-accel {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
