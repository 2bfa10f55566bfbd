"""run.py --preflight: in seconds, every import the chosen rows need, and what to bring where one fails.

Why: a loan is minutes long. The first one lost a row to DeepSpeed without pydantic (accelerate imports DeepSpeed to
unwrap a model at save_pretrained, DeepSpeed imports pydantic), found only at the row's first save. Importing what
the rows import, in this process, finds that before any model is built. Also checked: the offline tokenizer builds
(no download anywhere on the GPU path), transformers' activation offload (the fair TRL baseline), host memory and
disk for the random checkpoints.

    python benchmarks/campaign/run.py --preflight [--rows ...]
"""

from __future__ import annotations

import importlib
import shutil
import time
from pathlib import Path

WHEELS = "../shared/gpu/fetch_wheels.sh (its header has the install line)"
# What a failed import means on our GPU hosts, and where the fix comes from.
BRING = {
    "pydantic": f"pydantic and its needs: {WHEELS}",
    "deepspeed": f"deepspeed (a pure-Python wheel built there) + pydantic: {WHEELS}",
    "bitsandbytes": f"bitsandbytes (4-bit rows): {WHEELS}",
    "trl": f"trl==1.16.0: {WHEELS}",
    "datasets": f"datasets, dill, multiprocess: {WHEELS}",
}


def check_import(name: str) -> tuple[bool, str]:
    """(importable, version or the error's first line)."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # ImportError, or a module that fails while importing (DeepSpeed without pydantic)
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return True, str(getattr(module, "__version__", "?"))


def preflight(rows, models: Path, need_disk_gib: float = 20.0) -> int:
    """Print one line per needed import (and which rows need it), then the offline checks; 1 when something must be
    brought, with one `error:` line naming it."""
    t0 = time.monotonic()
    needs: dict[str, list[str]] = {}
    for row in rows:
        for name in row.needs:
            needs.setdefault(name, []).append(row.name)
    missing = []
    for name, who in needs.items():
        ok, what = check_import(name)
        missing += [] if ok else [name]
        print(f"  {'ok     ' if ok else 'MISSING'} {name:<13} {what:<44} {len(who)} row(s): {', '.join(who[:4])}"
              + (" ..." if len(who) > 4 else ""))
    missing += offline_checks(models, need_disk_gib)
    if any(Path(row.script).name == "bench_unsloth.py" for row in rows):
        unsloth_line()  # its own site, its own import: said, not required (the other rows run without it)
    print(f"[preflight] {time.monotonic() - t0:.1f} s")
    if missing:
        print("error: the rows cannot run here. Fix: bring " + "; ".join(BRING.get(m, m) for m in missing))
        return 1
    print("[preflight] every import the rows need is here; nothing on their path downloads")
    return 0


def unsloth_line() -> None:
    """bench_unsloth.py --preflight's one line: does `import unsloth` work from UNSLOTH_SITE, which versions."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench_unsloth.py"
    out = subprocess.run([sys.executable, str(script), "--preflight"], capture_output=True, text=True)
    print("  unsloth: " + ((out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]))


def offline_checks(models: Path, need_disk_gib: float) -> list[str]:
    """The tokenizer built in code, the fair baseline's transformers, host memory and disk; what must be brought."""
    from harness import host_available_gib

    from campaign.random_models import offline_tokenizer

    missing = []
    try:
        tokens = offline_tokenizer()("offline")["input_ids"]
        print(f"  ok      tokenizer     built in code ({len(tokens)} tokens for 'offline'), no download")
    except Exception as exc:
        missing.append(f"the tokenizers package ({type(exc).__name__}: {exc})")
    import dataclasses

    from trl import GRPOConfig

    if "activation_checkpointing_kwargs" not in {f.name for f in dataclasses.fields(GRPOConfig)}:
        print("  note    transformers  no activation offload (< 5.20): trl_tuned verdicts are marked weaker than fair "
              "unless a newer transformers wheel is brought")
    host = host_available_gib()
    target = models if models.exists() else models.parent
    disk = shutil.disk_usage(target).free / 2**30 if target.exists() else None
    print(f"  info    host memory   {host or 0:.0f} GiB available; disk at {target}: "
          + (f"{disk:.0f} GiB free" if disk is not None else "?"))
    if disk is not None and disk < need_disk_gib:
        missing.append(f"{need_disk_gib:g} GiB of free disk at {target} for a 16 GB random checkpoint")
    return missing
