"""A process that only plans does not import what training needs: transformers imports it eagerly under TRL's config.

TRL 1.16's GRPOConfig subclasses transformers' TrainingArguments, and building one imports two things a plan never
uses (it builds a config, reads no weights, trains nothing). Measured with `python -X importtime` on 2 cores:
- peft and bitsandbytes (~5 s with torch._inductor and torch._dynamo under it): `transformers.trainer_utils` runs
  `from peft import PeftModel, PeftMixedModel` whenever peft is installed. Hidden from transformers' availability
  check (`importlib.util.find_spec`) while `transformers.trainer_utils` is first imported, and only then.
  Transformers caches that check (`is_peft_available` is an lru_cache), so for the rest of that process it sees no
  peft.
- `transformers.modeling_utils` with its fp8 and conversion-mapping modules (~3 s, torch._dynamo again):
  `TrainingArguments.__post_init__` runs `from .integrations import is_kubeflow_available`, and that lazy name's
  module (`integration_utils`) imports PreTrainedModel. The name is answered here, by `is_kubeflow_available` below
  (upstream's two environment checks; tests/test_cli_startup.py fails when the two disagree), for the duration of the
  context only.
Use `training_imports_skipped()` only in a process that never loads an adapter (the `grpo-accel` console command, not
launch/train.py). Where transformers.trainer_utils or peft is already imported it does nothing.
tests/test_cli_startup.py checks that the plan it prints equals the in-process plan with everything imported.

Upstream: transformers 5.2x (pinned >=5.0,<6). Remove when trainer_utils imports peft lazily and TrainingArguments
checks Kubeflow without importing the model classes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys


def is_kubeflow_available() -> bool:
    """transformers.integrations.integration_utils.is_kubeflow_available (5.2x), without that module's imports."""
    if os.getenv("DISABLE_KUBEFLOW_INTEGRATION", "FALSE").upper() == "TRUE":
        return False
    return os.getenv("KUBEFLOW_TRAINER_SERVER_URL") is not None


@contextlib.contextmanager
def training_imports_skipped():
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
    import transformers.integrations as integrations  # a lazy module: this imports none of its submodules

    # an attribute set on the lazy module answers `from .integrations import is_kubeflow_available` without the
    # loader; deleted after, so a later import of the name gets upstream's function
    integrations.is_kubeflow_available = is_kubeflow_available
    try:
        yield
    finally:
        if integrations.__dict__.get("is_kubeflow_available") is is_kubeflow_available:
            del integrations.is_kubeflow_available
