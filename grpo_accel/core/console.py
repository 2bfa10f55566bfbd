"""One-line progress messages from the main process (rank 0), prefixed so they stand out of library logs."""

from grpo_accel.core.processes import process_rank


def log(msg: str) -> None:
    if process_rank() == 0:
        print(f"[grpo_accel] {msg}", flush=True)
