"""What every benchmark shares: the long-format CSV (merge by key, keep other devices' rows) and run metadata."""

from __future__ import annotations

import csv
import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


def merge_csv(rows: list[dict], path: Path, key=("op", "impl", "shape", "device")) -> list[dict]:
    """Replace the rows of `path` that share `key` with the new ones; keep everything else (e.g. GPU rows
    measured elsewhere when re-running on CPU). Returns the file's rows."""
    fresh = {tuple(r[k] for k in key) for r in rows}
    old = []
    if path.exists():
        with path.open() as f:
            old = [r for r in csv.DictReader(f) if tuple(r[k] for k in key) not in fresh]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(old + rows)
    return old + rows


def write_results(rows: list[dict], path: Path, meta: tuple[str, str, str], plot=None,
                  key=("op", "impl", "shape", "device")) -> list[dict]:
    """Every benchmark's tail: stamp `rows` with run_meta's (versions, git sha, device) and today's date, merge them
    into `path`, redraw the PNG beside it with `plot(all_rows, png_path)`, and say where. Returns the file's rows."""
    versions, sha, dev = meta
    today = datetime.date.today().isoformat()
    for r in rows:
        r.update(device=dev, versions=versions, git_sha=sha, date=today)
    all_rows = merge_csv(rows, path, key)
    if plot is not None:
        plot(all_rows, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if plot is not None else ""), flush=True)
    return all_rows


def run_meta(device: str, packages=("torch", "trl")) -> tuple[str, str, str]:
    """(versions, git sha, device description) for the CSV's columns."""
    import importlib

    import torch

    versions = []
    for name in packages:
        try:
            versions.append(f"{name}={importlib.import_module(name).__version__}")
        except ImportError:
            pass
    # GRPO_ACCEL_GIT_SHA: for copies of the tree without .git (a GPU machine that receives the files only)
    sha = os.environ.get("GRPO_ACCEL_GIT_SHA")
    if not sha:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    if device == "cuda":
        dev = torch.cuda.get_device_name()
    else:
        dev = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return " ".join(versions), sha or "unknown", dev
