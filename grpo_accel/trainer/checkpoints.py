"""The newest checkpoint a run can resume from.

transformers lists a run's checkpoint-N directories (`sort_checkpoints`, by step); its `get_last_checkpoint`
returns the newest one even when a kill cut its save short, and resuming from that fails. The Trainer writes
trainer_state.json last, so a checkpoint whose trainer_state.json parses is complete
(tests/test_resume.py's interrupted-save test)."""

from __future__ import annotations

import json
import os

from transformers.trainer_utils import sort_checkpoints

from grpo_accel.core.console import log


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint-N under `output_dir` whose trainer_state.json parses (skipping, with one line each,
    newer ones a kill left incomplete), or None."""
    for path in reversed(sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []):
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                json.load(f)
            return path
        except (OSError, ValueError):
            log(f"skipping incomplete checkpoint {path} (interrupted save)")
    return None
