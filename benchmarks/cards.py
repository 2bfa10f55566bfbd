"""One card per results CSV: the command that writes it, and each run it holds (machine, versions, date, sha) with its
table, drawn from the CSV itself. The reference pages (docs/) say what a measurement shows and link its card; the
dates and commits live here and in the git log, not in the prose.

    python benchmarks/cards.py            # rewrite benchmarks/results/<name>.md for every <name>.csv
    python benchmarks/cards.py --check    # exit 1 naming each card that is not what its CSV gives (tests run this)
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
# the script that writes each CSV, where the file name alone does not say it (bench_<name>.py otherwise)
WRITERS = {"presets_gpu": "gpu_presets.py", "gpu_campaign": "campaign/run.py", "step_memory": "bench_step_memory.py"}
LONG_TABLE = 40  # rows up to this many print as they are; more are pivoted: one row per (impl, shape)


def writer(name: str) -> Path:
    return BENCH / WRITERS.get(name, f"bench_{name}.py")


def commands(script: Path) -> list[str]:
    """The command lines of the script's docstring (`python ...`, `.venv-vllm/bin/python ...`, `accelerate ...`)."""
    if not script.exists():
        return []
    doc = re.match(r'\s*"""(.*?)"""', script.read_text(), re.S)
    lines = (doc.group(1) if doc else "").splitlines()
    return [ln.strip() for ln in lines if re.match(r"\s*(python|\.venv\S*/bin/python|accelerate|make)\b", ln)]


def fmt(value: str) -> str:
    try:
        x = float(value)
    except ValueError:
        return value
    if not math.isfinite(x):  # nan, inf: a figure a run could not have (written as Python spells it)
        return value
    return f"{x:.4g}" if x != int(x) or abs(x) >= 1e6 else str(int(x))


def table(rows: list[dict]) -> list[str]:
    if len(rows) <= LONG_TABLE:
        out = ["| op | impl | shape | metric | value | unit |", "| --- | --- | --- | --- | --- | --- |"]
        return out + [f"| {r['op']} | {r['impl']} | {r['shape']} | {r['metric']} | {fmt(r['value'])} | {r['unit']} |"
                      for r in rows]
    metrics = list(dict.fromkeys(f"{r['metric']} ({r['unit']})" for r in rows))
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in rows:  # the last value of a metric when a key repeats (per-step rows: the last step)
        cells[(r["impl"], r["shape"])][f"{r['metric']} ({r['unit']})"] = fmt(r["value"])
    out = ["| impl | shape | " + " | ".join(metrics) + " |",
           "| --- | --- | " + " | ".join("---" for _ in metrics) + " |"]
    return out + [f"| {impl} | {shape} | " + " | ".join(c.get(m, "") for m in metrics) + " |"
                  for (impl, shape), c in cells.items()]


def card(csv_path: Path) -> str:
    name = csv_path.stem
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    script = writer(name)
    rel = script.relative_to(BENCH)
    lines = [f"# {name}.csv", "", f"Written by `benchmarks/{rel}`; its commands:", ""]
    lines += ["```bash", *(commands(script) or [f"python benchmarks/{rel} --help"]), "```", ""]
    if csv_path.with_suffix(".png").exists():
        lines += [f"![{name}]({name}.png)", ""]
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        runs[(r.get("device", ""), r.get("versions", ""), r.get("git_sha", ""), r.get("date", ""))].append(r)
    if not runs:
        lines += ["No rows yet.", ""]
    for (device, versions, sha, date), group in sorted(runs.items(), key=lambda kv: (kv[0][3], kv[0][2]),
                                                       reverse=True):
        lines += [f"## {date}, {sha}: {device}", "", f"Versions: {versions}. {len(group)} rows.", "", *table(group), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for path in sorted(RESULTS.glob("*.csv")):
        text, target = card(path), path.with_suffix(".md")
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
    if stale:
        print(f"error: stale cards {', '.join(stale)}. Fix: python benchmarks/cards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
