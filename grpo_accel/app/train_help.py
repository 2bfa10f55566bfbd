"""`launch/train.py --help` in a fraction of a second: the parser's text, rendered once and shipped in the package.

The live parser (`run_spec.RunParser`) needs TRL's GRPOConfig, whose import pulls torch, transformers' trainer
utilities, peft and bitsandbytes: 13 s on 2 cores for a page of text. The shipped text is that parser's own output for
the TRL, transformers and Python versions named on its first line; with any other version installed the live parser
prints it (slow, but never stale). tests/test_cli_startup.py fails when the shipped text is not the live parser's,
so a TRL or flag change regenerates it:

    python -m grpo_accel.app.train_help --write
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

HELP_FILE = Path(__file__).with_name("train_help.txt")
COLUMNS = 120  # argparse wraps at the terminal's width: one fixed width, so the text does not depend on who wrote it
VERSIONED = ("trl", "transformers")  # the packages whose fields the text lists


def versions_line() -> str:
    """What the text depends on: the fields (TRL's, transformers') and argparse's layout (Python's minor version)."""
    python = f"python {sys.version_info.major}.{sys.version_info.minor}"
    return "# " + ", ".join([*(f"{name} {metadata.version(name)}" for name in VERSIONED), python])


def live_help() -> str:
    """The live parser's --help at COLUMNS wide (imports TRL)."""
    from grpo_accel.app.run_spec import RunParser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)
    try:
        return RunParser().format_help()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def shipped_help() -> str | None:
    """The shipped text, or None where it was written for other versions than these (or is missing)."""
    try:
        first, text = HELP_FILE.read_text().split("\n", 1)
    except (FileNotFoundError, ValueError):
        return None
    return text if first == versions_line() else None


def print_help() -> int:
    """What `launch/train.py --help` prints: the shipped text, else the live parser's."""
    text = shipped_help()
    sys.stdout.write(text if text is not None else live_help())
    return 0


def write() -> None:
    HELP_FILE.write_text(f"{versions_line()}\n{live_help()}")
    print(f"wrote {HELP_FILE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m grpo_accel.app.train_help --write")
    write()
