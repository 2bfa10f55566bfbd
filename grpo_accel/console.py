"""One-line progress messages from the main process (rank 0), prefixed so they stand out of library logs."""

import os


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[grpo_accel] {msg}", flush=True)
