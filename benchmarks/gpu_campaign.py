"""Every pending GPU claim measured by one command, most important first, resumable across short GPU loans.

On a lent GPU host (set up as ../shared/gpu/README.md says), from the project root, the same command 2-3 times:

    GRPO_ACCEL_GIT_SHA=<sha of the code> python benchmarks/gpu_campaign.py --budget-s 560 2>&1 | tee campaign.log
    python benchmarks/gpu_campaign.py --list                 # the rows, their order, limits and goals
    python benchmarks/gpu_campaign.py --cpu-check            # no GPU: the same plumbing, tiny model and sizes

Each row runs an existing benchmark script in its own process group with its own time limit (a hang is killed with
its workers, and the next row runs), appends long-format CSVs + PNGs under --results (benchmarks/results), and
is recorded in the ledger gpu_campaign.csv. A row already in the ledger for this git sha and device is skipped:
that is the resume (--redo NAME runs one again). A row whose limit exceeds what is left of --budget-s is not
started: the command stops and says to run it again. After every row the summary (gpu_campaign_summary.md: GPU,
versions, date, sha, measured vs goal, the planner's error per preset) is rewritten and, with --mirror (default
$OUT), copied there, so a loan that ends mid-way still returns every finished row. docs/gpu-campaign.md has more.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # grpo_accel from a checkout

import campaign_summary as summary  # noqa: E402  (benchmarks/ is on sys.path as a script)
from results_io import ROOT, merge_csv, run_meta  # noqa: E402

BENCH = ROOT / "benchmarks"
LEDGER = "gpu_campaign.csv"
SUMMARY = "gpu_campaign_summary.md"
CPU_LIMIT_S = 240  # a CPU check row: tiny sizes, but each process imports torch + transformers + TRL (~10 s here)


@dataclass(frozen=True)
class Row:
    name: str
    measures: str
    goal: str
    limit_s: int  # its own time limit on the GPU; a lease is 10 minutes, so each stays under ~9
    script: str  # under benchmarks/, or an absolute path
    csv: str  # the results CSV the script writes (under --results)
    op: str  # the op of the CSV rows that carry the row's figures
    judge: Callable
    args: tuple = ()  # flags of both modes (impls, reps, mode switches): the CPU check runs the GPU's wiring
    gpu: dict = field(default_factory=dict)  # sizes on the GPU, flag name -> value
    cpu: dict = field(default_factory=dict)  # tiny sizes for --cpu-check
    shape: str = ""  # the CSV shape's prefix, formatted with the sizes
    note: str = ""
    cpu_limit_s: int = CPU_LIMIT_S

    def limit(self, cpu: bool) -> int:
        return self.cpu_limit_s if cpu else self.limit_s

    def sizes(self, cpu: bool) -> dict:
        return self.cpu if cpu else self.gpu

    def shape_prefix(self, cpu: bool) -> str:
        s = self.sizes(cpu)
        return self.shape.format(adapter="qlora-r16" if s.get("quant") == "4bit" else "lora-r16", **s)

    def script_path(self) -> Path:
        return Path(self.script) if os.path.isabs(self.script) else BENCH / self.script


def flags(sizes: dict) -> list[str]:
    return [x for k, v in sizes.items() for x in (f"--{k.replace('_', '-')}", str(v))]


_STEP = "{arch},{adapter},G={num_generations},P={prompt_length},T={completion_length},"
_TINY = dict(arch="tiny-llama", num_generations=2, prompt_length=4)
# Most important first: the H100 preset and the planner, the fair step against tuned TRL, the seeds' table, the
# longest completion, packing, shared prompts; then the other presets (smaller GPUs' recipes run on this one).
ROWS = [
    Row("step_32k", "one GRPO step, Qwen3-8B QLoRA, G=8, T=32K: ours at micro-batch 1 vs tuned TRL, side by side",
        "peak reserved <= 0.5x trl_tuned's, step time <= 1.1x", 540, "bench_step_memory.py", "step_memory.csv",
        "grpo_step_fwd_bwd", summary.judge_step_32k, ("--impls", "trl_tuned", "ours_mb1", "--reps", "1"),
        dict(arch="qwen3-8b", quant="4bit", num_generations=8, prompt_length=64, completion_length=32768),
        dict(_TINY, completion_length=8), _STEP,
        note="trl_tuned is the fair baseline only with transformers >= 5.20 (its activation offload); the GPU hosts "
             "have 5.17: bring a newer transformers wheel, or the verdict is marked weaker than fair."),
    Row("seeds_20k", "the seeds' table: Llama-3.1-8B LoRA bf16, 20K context (512 + 19968), G=8",
        "peak reserved with weights <= 27 GB (half Unsloth's 54.3 GB)", 420, "bench_step_memory.py",
        "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_seeds_20k,
        ("--impls", "trl_tuned", "ours_mb1", "--reps", "0"),
        dict(arch="llama-3.1-8b", num_generations=8, prompt_length=512, completion_length=19968),
        dict(_TINY, prompt_length=8, completion_length=12), _STEP,
        note="--reps 0: the peak of the first step (a memory goal; no time is compared)."),
    Row("max_t_ours", "longest completion, Qwen3-8B QLoRA: does one step at T=256K fit, ours at micro-batch 1",
        "fits at T >= 256K", 560, "bench_step_memory.py", "step_memory.csv", "grpo_step_fwd_bwd",
        summary.judge_max_t_ours, ("--impls", "ours_mb1", "--reps", "0"),
        dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=262144),
        dict(_TINY, completion_length=16), _STEP,
        note="G=2: at micro-batch 1 each row is its own forward + backward, so the peak does not grow with G "
             "(but for [G, T] buffers of MiBs); G=8 would take 4x as long, more than a loan. One probe at 262144: "
             "a lower bound, not a bisection."),
    Row("max_t_trl", "longest completion, Qwen3-8B QLoRA: tuned TRL bisected (first probe: the planner's)",
        "ours >= 2x trl_tuned's longest", 540, "bench_step_memory.py", "step_memory.csv",
        "grpo_max_completion_length", summary.judge_max_t_trl, ("--find-max-t", "--impls", "trl_tuned"),
        dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=65536,
             t_step=16384, max_t=196608),
        dict(_TINY, completion_length=8, t_step=8, max_t=16),
        "{arch},{adapter},G={num_generations},P={prompt_length},T<=max,step={t_step},",
        note="G=2 as max_t_ours; capped at 196608 (past 131072 the 2x goal is missed either way)."),
    Row("packing", "padded vs packed rows, uniform completion lengths, Llama-3.1-8B LoRA bf16, G=8, T=8192",
        ">= 1.5x faster, <= 0.7x peak", 420, "bench_packing.py", "packing.csv", "grpo_step_fwd_bwd",
        summary.judge_packing, ("--mixes", "uniform", "--reps", "1", "--offload", "true"),
        dict(arch="llama-3.1-8b", num_generations=8, prompt_length=256, completion_length=8192),
        dict(_TINY, num_generations=4, completion_length=8),
        "{arch},lora-r16,G={num_generations},P<={prompt_length},T<={completion_length},uniform,"),
    Row("shared_prompt", "the prompt once per group vs G times, Qwen3-8B LoRA bf16, P=8K, C=1K, G=16: shared vs "
        "packed vs TRL's padded rows", ">= 3x faster, <= 1/3 peak of packed (issue 28)", 480,
        "bench_shared_prompt.py", "shared_prompt.csv", "grpo_policy_step", summary.judge_shared_prompt,
        ("--impls", "shared", "packed", "trl_padded", "--reps", "1"),
        dict(arch="qwen3-8b", prompt_lengths=8192, completion_lengths=1024, generations_grid=16, offload="true"),
        dict(arch="tiny-llama", prompt_lengths=16, completion_lengths=8, generations_grid=2),
        "{arch},lora-r16,2x{generations_grid} rows,P={prompt_lengths},C<={completion_lengths},",
        note="the script's own GPU command (issue 28)."),
]


def preset_rows(cpu: bool, gpu_props) -> tuple[list[Row], list[tuple[str, str]]]:
    """A row per single-GPU preset this GPU can run (the cpu preset for the CPU check), h100_110k first; and the
    ones it cannot, with why."""
    from grpo_accel.app.presets import PRESETS, check_preset_fits_gpu

    names = ["cpu"] if cpu else sorted((n for n, p in PRESETS.items() if p.is_gpu and p.num_processes == 1),
                                       key=lambda n: (n != "h100_110k", -PRESETS[n].min_gpu_mem_gib))
    rows, skipped = [], []
    for name in names:
        if not cpu:
            try:
                check_preset_fits_gpu(PRESETS[name], gpu_props)
            except Exception as exc:
                skipped.append((f"preset_{name}", str(exc)))
                continue
        rows.append(Row(f"preset_{name}", f"preset {name}: 2 GRPO steps through accelerate launch, vs the planner",
                        "completes; planner within 10% of measured reserved", 540 if name == "h100_110k" else 420,
                        "gpu_presets.py", "presets_gpu.csv", "preset_2_steps", summary.judge_preset,
                        ("--presets", name, "--completion-length", "8" if cpu else "1024")
                        + (("--cpu-check",) if cpu else ())))
    return rows, skipped


def campaign_rows(cpu: bool, gpu_props) -> tuple[list[Row], list[tuple[str, str]]]:
    presets, skipped = preset_rows(cpu, gpu_props)
    return presets[:1] + ROWS + presets[1:], skipped


def command(row: Row, cpu: bool, results: Path, logs: Path, models: Path) -> list[str]:
    cmd = [sys.executable, str(row.script_path()), *row.args, *flags(row.sizes(cpu))]
    if row.script == "gpu_presets.py":  # its --out is the runs' folder; --csv the results
        return cmd + ["--csv", str(results / row.csv), "--out", str(logs / "presets"), "--models-dir", str(models),
                      "--timeout-s", str(max(60, row.limit(cpu) - 60))]
    if row.script == "bench_step_memory.py" and row.gpu.get("quant") == "4bit":
        cmd += ["--ckpt-cache", str(models)]  # the 4-bit checkpoints beside the presets' models
    return cmd + ["--out", str(results / row.csv)]


def run_limited(cmd: list[str], log: Path, limit_s: float, env: dict) -> tuple[int | None, float]:
    """(exit code, or None when killed at `limit_s`; seconds). Its own session: a timeout kills the benchmark's
    worker processes too, which would otherwise hold the GPU through every later row."""
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - t0


def free_disk(models: Path, need_gib: float = 24.0) -> None:
    """Random checkpoints are remade in minutes; 64 GiB of disk holds three 8B ones: drop them before it fills."""
    if models.exists() and shutil.disk_usage(models).free < need_gib * 2**30:
        print(f"[campaign] < {need_gib:g} GiB free: removing {models}", flush=True)
        shutil.rmtree(models, ignore_errors=True)


def mirror_results(results: Path, mirror: Path | None) -> None:
    if mirror is None:
        return
    target = mirror / "benchmarks" / "results"
    target.mkdir(parents=True, exist_ok=True)
    for path in results.glob("*"):
        if path.suffix in (".csv", ".png", ".md") and path.is_file():
            shutil.copy2(path, target / path.name)


def write_summary(rows, skipped, meta, results):
    ledger = summary.read_rows(results / LEDGER)
    views = {}
    for row in rows:
        views[row.name] = summary.RowView(row, meta["cpu"], results, meta["sha"], meta["device"], views,
                                          meta["versions"])
    entries = []
    for row in rows:
        state = summary.ledger_state(ledger, row.name, meta["sha"], meta["device"])
        measured, verdict = row.judge(views[row.name])
        entries.append(dict(name=row.name, measures=row.measures, goal=row.goal, note=row.note, measured=measured,
                            verdict=verdict, state=summary.describe_state(state, row.script_path().exists())))
    summary.write_summary(results / SUMMARY, meta, entries, skipped, results)
    return entries


def run_campaign(rows, skipped, meta, results: Path, logs: Path, models: Path, budget_s: float | None = None,
                 redo=(), mirror: Path | None = None) -> list[dict]:
    """Run every row not yet in the ledger for this sha and device, in order; the summary after each."""
    t0, cpu = time.monotonic(), meta["cpu"]
    results.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GRPO_ACCEL_GIT_SHA=meta["sha"])  # every script stamps the same sha, .git or not
    for row in rows:
        done = summary.ledger_state(summary.read_rows(results / LEDGER), row.name, meta["sha"], meta["device"])
        if done is not None and row.name not in redo:
            print(f"[campaign] {row.name}: skipped, in the ledger for {meta['sha']} "
                  f"({summary.describe_state(done, True)})")
            continue
        if not row.script_path().exists():
            print(f"[campaign] {row.name}: script not present yet ({row.script_path()})")
            continue
        limit = row.limit(cpu)
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if left is not None and limit > left:
            print(f"[campaign] stopped before {row.name}: its limit is {limit} s, {left:.0f} s of --budget-s left. "
                  f"Run the same command again to go on.", flush=True)
            break
        cmd = command(row, cpu, results, logs, models)
        print(f"[campaign] {row.name} (limit {limit} s): {' '.join(cmd[1:])}", flush=True)
        code, seconds = run_limited(cmd, logs / f"{row.name}.log", limit, env)
        print(f"[campaign] {row.name}: " + (f"exit {code}" if code is not None else "timed out") + f", {seconds:.0f} s",
              flush=True)
        record = dict(exit_code=-9 if code is None else code, timed_out=float(code is None), wall_s=round(seconds, 1),
                      limit_s=limit)
        merge_csv([dict(op="gpu_campaign", impl=row.name, shape=" ".join(flags(row.sizes(cpu))) or "-", metric=k,
                        value=v, unit={"wall_s": "s", "limit_s": "s"}.get(k, "code"), device=meta["device"],
                        versions=meta["versions"], git_sha=meta["sha"], date=meta["date"]) for k, v in record.items()],
                  results / LEDGER, key=("op", "impl", "device", "git_sha", "metric"))
        write_summary(rows, skipped, meta, results)
        mirror_results(results, mirror)
        if not cpu:
            free_disk(models)
    entries = write_summary(rows, skipped, meta, results)
    mirror_results(results, mirror)
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true", help="no GPU: every row's script at tiny sizes on CPU")
    ap.add_argument("--results", type=Path, help="CSVs, PNGs, ledger, summary (default: benchmarks/results; "
                    "--cpu-check: /tmp/grpo_accel_campaign_cpu/results)")
    ap.add_argument("--logs", type=Path, help="one log per row (default: $OUT/campaign_logs, else /tmp; "
                    "--cpu-check: beside --results)")
    ap.add_argument("--models", type=Path, help="random checkpoints (default: /tmp/grpo_accel_gpu_models; "
                    "--cpu-check: beside --results)")
    ap.add_argument("--budget-s", type=float, help="start no row whose limit exceeds what is left (a loan's length)")
    ap.add_argument("--rows", nargs="+", help="only these rows (names as --list prints them)")
    ap.add_argument("--redo", nargs="+", default=[], help="run these rows again although the ledger has them")
    ap.add_argument("--mirror", type=Path, help="copy results here after each row (default on a GPU: $OUT, what a "
                    "GPU loan returns; never by default for --cpu-check, whose figures are not results)")
    ap.add_argument("--list", action="store_true", help="print the rows in order and exit (no GPU: as on an H100)")
    ap.add_argument("--summary-only", action="store_true", help="rewrite the summary from the CSVs, run nothing "
                    "(no GPU: every row pending on an assumed H100, and the planner against the GPU rows there are)")
    args = ap.parse_args(argv)

    import torch

    from grpo_accel.app.presets import GPUProps, current_gpu_props

    cuda, cpu = torch.cuda.is_available(), args.cpu_check
    if not cuda and not cpu and not (args.list or args.summary_only):
        print("error: no CUDA GPU here. Fix: run on a GPU host, or --cpu-check to test the plumbing.", file=sys.stderr)
        return 2
    gpu = current_gpu_props() or GPUProps("NVIDIA H100 80GB HBM3 (assumed: no GPU here)", int(79.1 * 2**30), 9, 0, 1)
    rows, skipped = campaign_rows(cpu, None if cpu else gpu)
    if args.rows:
        unknown = set(args.rows) - {r.name for r in rows}
        if unknown:
            print(f"error: unknown rows {sorted(unknown)}; --list names them", file=sys.stderr)
            return 2
        rows = [r for r in rows if r.name in args.rows]
    if args.list:
        for i, r in enumerate(rows, 1):
            print(f"{i:2d}. {r.name:<22} limit {r.limit_s:>3d} s  goal: {r.goal}")
        for name, why in skipped:
            print(f"    {name:<22} not on this GPU: {why}")
        return 0
    versions, sha, device = run_meta("cpu" if cpu or not cuda else "cuda", ("torch", "transformers", "trl",
                                                                           "bitsandbytes"))
    if not (cpu or cuda):  # --summary-only here: this machine's versions would read as the GPU run's
        versions, device = "n/a (written without a GPU: nothing measured here)", gpu.name
    meta = dict(cpu=cpu, versions=versions, sha=sha, device=device, date=datetime.date.today().isoformat())
    results = args.results or (Path("/tmp/grpo_accel_campaign_cpu/results") if cpu else BENCH / "results")
    scratch = results.parent if cpu else Path(os.environ.get("OUT", "/tmp"))
    logs = args.logs or scratch / "campaign_logs"
    models = args.models or (results.parent / "models" if cpu else Path("/tmp/grpo_accel_gpu_models"))
    mirror = args.mirror or (None if cpu or "OUT" not in os.environ else Path(os.environ["OUT"]))
    if args.summary_only:
        write_summary(rows, skipped, meta, results)
        mirror_results(results, mirror)
        print(f"[campaign] wrote {results / SUMMARY}")
        return 0
    entries = run_campaign(rows, skipped, meta, results, logs, models, args.budget_s, args.redo, mirror)
    print(f"[campaign] summary: {results / SUMMARY}")
    for e in entries:
        print(f"  {e['name']:<22} {e['state']:<34} {e['verdict'] or 'pending'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
