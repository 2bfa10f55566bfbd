"""Upstream lines a user cannot act on, kept off the screen where our code triggers them.

    with quiet_upstream():
        from trl import GRPOConfig      # transformers imports DeepSpeed, which names the CPU accelerator it picked

Each entry names who says it, the one message, and why nobody can act on it. Only those messages, only inside the
`with`: every other warning and log record, and the same ones raised by a user's own code outside it, still show.
Nothing is left behind: logging filters are removed and the warnings filters restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

# (the logger the library logs on, message pattern): logging records dropped inside quiet_upstream()
LOG_RECORDS = (
    # bitsandbytes 0.50's CPU backend, on a CPU with AVX512-BF16, when it is imported (a run with 4-bit weights, or
    # a process that imports peft outside launch/train.py, which hides it from the others: app/bitsandbytes_gate.py):
    # an optional faster 4-bit GEMM from the hub (kernels-community), which offline machines cannot fetch
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # DeepSpeed, when accelerate or transformers import it on a machine without CUDA: it picks the CPU accelerator,
    # which is what a CPU run wants
    ("DeepSpeed", r"Setting accelerator to CPU"),
)
# (category, message pattern): warnings ignored inside quiet_upstream()
WARNINGS = (
    # transformers 5.2x deprecates the property TRL 1.16 reads around each generation (trl/models/utils.py)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # torch's DataLoader on a machine without CUDA: TRL defaults dataloader_pin_memory to True, pinning needs an
    # accelerator, and torch goes on unpinned (what a CPU run does anyway)
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_upstream():
    """Drop LOG_RECORDS and WARNINGS (module docstring) raised inside the block. A logger's filter sees the records
    made on that logger (not its children's), so each entry names the logger the library logs on."""
    filters = [(logging.getLogger(name), _DropMatching(pattern)) for name, pattern in LOG_RECORDS]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        with warnings.catch_warnings():
            for category, pattern in WARNINGS:
                warnings.filterwarnings("ignore", message=pattern, category=category)
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


__all__ = ["LOG_RECORDS", "WARNINGS", "quiet_upstream"]
