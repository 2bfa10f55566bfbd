"""`grpo-accel` command: presets, plan, report.

    grpo-accel presets                                        # the preset table with predicted peaks
    grpo-accel plan --preset h100_110k                        # breakdown, checks, verdict; exit 1 when it cannot run
    (what this machine lacks for the run's machine - vLLM's client, DeepSpeed, its GPU - is a warning, not exit 1)
    grpo-accel plan --preset l4_24gb_qlora --max_completion_length 32768 --gpu-mem-gib 22
    grpo-accel plan --preset a100_80gb_bf16 --model ./my_model_dir   # any config.json / named architecture
    (plan takes launch/train.py's flags, so it plans exactly what train.py with the same flags would run)
    grpo-accel report runs/demo                               # PNGs of a finished or crashed run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable

from grpo_accel.core.units import GIB
from grpo_accel.planning.generation import kv_cache_sequences, vllm_memory_fraction


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
    from grpo_accel.app.presets import preset_table_rows

    headers = dict(name="preset", gpu="GPU", model="model", precision="precision", lora_r="LoRA r",
                   completion="completion", generations="G", route="generation", peak_gib="peak GiB",
                   yaml="accelerate YAML")
    print(_table(preset_table_rows(), headers))
    print("\npeak GiB: the planner's prediction per GPU (host RAM for the cpu presets); "
          "`grpo-accel plan --preset NAME` for the breakdown.\ngeneration: the route with the vllm extra installed "
          "(vllm_4bit: vLLM's own 4-bit copy, bitsandbytes in vLLM 0.26's tree or vllm-bnb-plugin on 0.32; "
          "vllm_shared: vLLM on the trainer's weights; vllm_copy: its own copy, asleep while training; generate: "
          "transformers' generate()); without vLLM every "
          "preset generates with transformers' continuous batching (route continuous_batching, a planned page pool),"
          " which the plan sizes (`grpo-accel plan` on that machine).")
    return 0


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-mem-gib", type=float, help="GPU memory to plan for (default: this GPU, else the preset's "
                   "minimum)")
    p.add_argument("--host-mem-gib", type=float, help="host memory for offloaded activations (default: this "
                   "machine's when it has the GPU, else unchecked)")
    p.add_argument("--stack", choices=("here", "pinned"), default="here", help="the generation stack to plan for: "
                   "this machine's vLLM / vllm-bnb-plugin (here), or the preset's GPU machine with the vllm extra "
                   "installed (pinned)")
    p.add_argument("--find-max-t", action="store_true", help="print the longest completion (tokens per sequence) "
                   "that fits this GPU and host, and the model's context limit")
    p.epilog = ("Every other flag is launch/train.py's (--preset, --model, --max_completion_length, --quantization, "
                "--offload_activations, ...): plan prints what train.py with the same flags would run.")


def cmd_plan(args, train_flags: list[str]) -> int:
    from grpo_accel.app.presets import current_gpu_props
    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.app.startup_checks import machine_checks, model_config, plan_checks

    spec = resolve_run_spec(train_flags, for_plan=True)
    if args.stack == "pinned":
        from grpo_accel.planning.routes import PINNED_STACK

        spec.stack = PINNED_STACK
    elif spec.preset.is_gpu and not spec.stack.cuda:  # this machine's vLLM and plugin, on the preset's GPU
        spec.stack = dataclasses.replace(spec.stack, cuda=True)
    preset = spec.preset
    plan = spec.plan()
    route, route_why = spec.route()
    # What concerns the run's machine, not the plan (this GPU, client packages) warns: one plans for another machine.
    warnings = machine_checks(spec)
    gpu, gpu_bytes, where = _planned_gpu(args, preset, current_gpu_props(), warnings)
    print(_plan_header(spec, plan, route))
    print(f"generation route {route}: {route_why}")
    print(plan.format())
    planned_gpu = preset.is_gpu or args.gpu_mem_gib is not None
    failures = plan_checks(spec, model_config(spec, prefer_named=True), preset.max_prompt_length,
                           gpu_bytes if planned_gpu else None, host_bytes(args, gpu) if planned_gpu else None)
    if not planned_gpu:
        print("CPU preset: the peak is host RAM beyond the Python interpreter; no GPU verdict.")
    else:
        verdict = plan.verdict(gpu_bytes)
        print(f"GPU memory: {gpu_bytes / GIB:.1f} GiB ({where})")
        print(verdict)
        _print_route_memory(spec, plan, route, gpu_bytes, verdict.fits, warnings)
    for failure in failures:
        if not failure.startswith("memory:"):  # the verdict above already said it
            print(f"error: {failure}")
    pinned, _ = preset.route(spec.fields())
    if args.stack == "here" and route != pinned:
        warnings.append(f"this machine generates by route {route}; with the vllm extra installed it would be {pinned} "
                        f"(`--stack pinned` plans that)")
    for warning in warnings:
        print(f"warning: {warning}")
    if args.find_max_t and planned_gpu:
        print_max_completion(spec, plan, gpu_bytes, host_bytes(args, gpu))
        return 0
    return 1 if failures else 0


def _planned_gpu(args, preset, gpu, warnings: list[str]):
    """(this machine's GPU where it is the run's, else None; the bytes planned for; where they come from). A GPU
    that is not the preset's is a warning: one plans for another machine."""
    from grpo_accel.app.presets import PresetError, check_preset_fits_gpu

    if gpu is not None and preset.is_gpu and args.gpu_mem_gib is None:
        try:
            check_preset_fits_gpu(preset, gpu)
        except PresetError as exc:  # this GPU is not the run's: plan for the preset's, whose host is unknown
            warnings.insert(0, f"this machine's GPU is not the run's ({exc}); planned for {preset.name}'s minimum, "
                               f"the run's machine needs it (--gpu-mem-gib N plans for another size)")
            gpu = None
    if args.gpu_mem_gib is not None:
        return gpu, int(args.gpu_mem_gib * GIB), "--gpu-mem-gib"
    if gpu is not None and preset.is_gpu:
        return gpu, gpu.total_memory, gpu.name
    return gpu, int(preset.min_gpu_mem_gib * GIB), f"{preset.name}'s minimum"


def _plan_header(spec, plan, route: str) -> str:
    inp, shape = plan.inputs, plan.shape
    moe = (f", {shape.active_params / 1e9:.2f}B active: {shape.experts} experts, {shape.experts_per_token} per token"
           if shape.experts else "")
    return (f"preset {spec.preset.name} ({spec.preset_why}), generation route {route}, "
            f"model {shape.name} ({shape.n_params / 1e9:.2f}B params{moe}, "
            f"L={shape.layers} H={shape.hidden} V={shape.vocab}), {inp['model_dtype']}"
            f"{'+nf4' if inp['quantization'] == '4bit' else ''}, LoRA r={inp['lora_r'] or 'full'}, "
            f"{inp['per_device_train_batch_size']} x ({inp['max_prompt_length']} + {inp['max_completion_length']}) "
            f"tokens, G={inp['num_generations']}")


def _print_route_memory(spec, plan, route: str, gpu_bytes: int, fits: bool, warnings: list[str]) -> None:
    """What the route's generation holds on the GPU beside the verdict: KV cache, page pool, server, engine."""
    inp, preset = plan.inputs, spec.preset
    if route == "generate":
        print(f"generate(): {inp['generation_batch']} sequences x {inp['max_prompt_length']} + "
              f"{inp['max_completion_length']} tokens of KV cache at once "
              f"({plan.device['generate_kv_cache'] / GIB:.1f} GiB), freed before the training step")
    if route == "continuous_batching":
        seqs = min(inp["paged_seqs"] or inp["generation_batch"], inp["generation_batch"])
        print(f"continuous batching: page pool for {seqs} of {inp['generation_batch']} full-length sequences at "
              f"once ({inp['max_prompt_length']} + {inp['max_completion_length']} tokens, "
              f"{plan.device['paged_kv_cache'] / GIB:.1f} GiB; the rest wait in its queue), freed before the "
              f"training step")
    if route == "vllm_server":
        server = server_plan(spec, plan, gpu_bytes)
        print(server.format())
        if server.fits and preset.server_gpus and server.tensor_parallel_size > preset.server_gpus:
            warnings.append(f"the server needs {server.tensor_parallel_size} GPUs; preset {preset.name} expects "
                            f"{preset.server_gpus}")
    if fits and inp["use_vllm"]:
        frac = vllm_memory_fraction(plan, gpu_bytes)
        print(f"vLLM gpu_memory_utilization {frac:.3f}: KV cache for {kv_cache_sequences(plan, gpu_bytes)} "
              f"full-length sequences at once (of {inp['num_generations']} per prompt)")


def server_plan(spec, plan, gpu_bytes: int):
    """Route vllm_server: the server's own machine (planning/server.py), GPUs of the trainers' size, for the
    sequences one generation asks of it from every trainer process (a sequence-parallel group shares its sequences)."""
    from grpo_accel.planning.server import plan_server

    inp, fields = plan.inputs, spec.fields()
    groups = max(1, inp["num_processes"] // max(1, inp["sequence_parallel_size"]))
    return plan_server(plan.shape, model=fields["model"],
                       max_model_len=inp["max_prompt_length"] + inp["max_completion_length"],
                       generation_batch=inp["generation_batch"] * groups, gpu_bytes=gpu_bytes,
                       dtype=inp["model_dtype"], lora_r=int(fields.get("lora_r") or 0),
                       max_staleness=int(fields.get("max_staleness", 1)))


def host_bytes(args, gpu) -> int | None:
    if args.host_mem_gib is not None:
        return int(args.host_mem_gib * GIB)
    if gpu is None:
        return None  # planning for another machine: its host memory is unknown
    from grpo_accel.app.startup_checks import host_memory_bytes

    return host_memory_bytes()


def print_max_completion(spec, plan, gpu_bytes: int, host: int | None) -> None:
    """The longest completion the planner fits on this GPU (and host), beside the model's context."""
    from grpo_accel.app.startup_checks import context_tokens, model_config
    from grpo_accel.core.units import GIB
    from grpo_accel.planning.fitting import find_max_completion_length

    limit = 1 << 24  # 16.8M tokens: past that a plan is no longer a useful prediction
    longest, fitted = find_max_completion_length(plan, gpu_bytes, host, limit=limit)
    context = context_tokens(model_config(spec, prefer_named=True))
    prompt = plan.inputs["max_prompt_length"]
    where = f"{gpu_bytes / GIB:.1f} GiB GPU" + (f", {host / GIB:.0f} GiB host" if host else ", host unchecked")
    if not longest:
        print(f"longest completion: none fits ({where}) — a prompt of {prompt} tokens alone does not")
        return
    print(f"longest completion that fits ({where}): {'at least ' if longest >= limit else ''}{longest} tokens per "
          f"sequence (a prediction; device peak {fitted.peak_gib:.1f} GiB, host {sum(fitted.host.values()) / GIB:.1f} "
          f"GiB)")
    if context and prompt + longest > context:
        print(f"the model's context caps it at {context - prompt} tokens ({context} with {prompt} prompt tokens)")


# subcommand -> (help, add_arguments, handler); train / report register here
def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory, e.g. runs/demo")


def cmd_report(args) -> int:
    from grpo_accel.app.report import render_report

    for path in render_report(args.run_dir):
        print(path)
    return 0


COMMANDS: dict[str, tuple[str, Callable | None, Callable]] = {
    "presets": ("list the GPU presets with the planner's predicted peak", None, cmd_presets),
    "plan": ("plan a run (launch/train.py's flags): memory and start-up checks; exit 1 when it cannot run",
             add_plan_args, cmd_plan),
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
    from grpo_accel.core.upstream_noise import quiet_upstream

    with quiet_upstream():  # the lines the stack prints that a user cannot act on (core/upstream_noise.py)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from grpo_accel.core.errors import run_guarded

    args, rest = build_parser().parse_known_args(argv)
    if args.command == "plan":
        from grpo_accel._compat.plan_only import training_imports_skipped

        # the console command (no argv) plans and exits, never loading an adapter: it skips ~8 s of peft,
        # bitsandbytes and model-class imports TRL's config class does not need; a caller's process keeps
        # transformers as it is
        with training_imports_skipped() if argv is None else contextlib.nullcontext():
            return run_guarded(cmd_plan, args, rest)
    if rest:
        build_parser().parse_args(argv)  # argparse's own message for unknown arguments, exit 2
    return run_guarded(args.handler, args)


def console_main() -> None:
    """The `grpo-accel` command: main(), then the process ends without the interpreter's teardown of what `plan`
    imported (core/process_exit.py). main() itself returns, for callers in a process of their own (the tests)."""
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())


if __name__ == "__main__":
    console_main()
