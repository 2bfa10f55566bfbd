"""A process that only plans does not import peft: transformers imports it eagerly under TRL's config class.

TRL 1.16's GRPOConfig subclasses transformers' TrainingArguments, whose module imports `transformers.trainer_utils`,
which runs `from peft import PeftModel, PeftMixedModel` whenever peft is installed; peft imports bitsandbytes, which
imports torch._inductor and torch._dynamo. Measured with `python -X importtime` on 2 cores: 5.4 s of the 9-12 s that
`grpo-accel plan` took, for classes a plan never touches (it builds a config, reads no weights, trains nothing).

`peft_unseen()` hides peft from transformers' availability check (`importlib.util.find_spec`) while
`transformers.trainer_utils` is first imported, and only then. Cost: transformers caches that check
(`is_peft_available` is an lru_cache), so for the rest of that process transformers sees no peft: use it only in a
process that never loads an adapter (the `grpo-accel` console command, not launch/train.py). Where trainer_utils or
peft is already imported it does nothing.
tests/test_cli_startup.py checks that the plan it prints equals the in-process plan with peft imported.

Upstream: transformers 5.2x (pinned >=5.0,<6). Remove when trainer_utils imports peft lazily.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys


@contextlib.contextmanager
def peft_unseen():
    if "transformers.trainer_utils" in sys.modules or "peft" in sys.modules:
        yield
        return
    find_spec = importlib.util.find_spec

    def without_peft(name, *args, **kwargs):
        return None if name == "peft" else find_spec(name, *args, **kwargs)

    importlib.util.find_spec = without_peft
    try:
        import transformers.trainer_utils  # noqa: F401  (imported here, so later imports find it as it is)
    finally:
        importlib.util.find_spec = find_spec
    yield
