"""One-line progress messages from the main process (rank 0), prefixed so they stand out of library logs.

Why not accelerate's `get_logger(...).info(..., main_process_only=True)`: it raises until a PartialState exists, and
`grpo-accel plan`, the start-up checks and the run spec speak before any (they must not start a process group);
and its lines go through `logging`, whose level hides INFO unless a user configures it. These lines are the
product's voice (tests read them), so they are printed, flushed, from the launcher's rank 0."""

from grpo_accel.core.processes import process_rank


def log(msg: str) -> None:
    if process_rank() == 0:
        print(f"[grpo_accel] {msg}", flush=True)
