"""One forward hook per generation, never removed: the input-embedding hook that checkpointing re-registers.

TRL 1.16 generates with `generate()` (no vLLM) inside `unwrap_model_for_generation`, which turns gradient
checkpointing off and on again around every generation. transformers 5.2x's `activation_checkpointing_enable`
then calls `enable_input_require_grads()`, which registers a new `make_inputs_require_grads` forward hook on the
input embeddings and overwrites `_require_grads_hooks` with it; the disable side removes that list only for
transformers' own PEFT integration (`_hf_peft_config_loaded`), not for a `peft.PeftModel` wrapper. So every
generation leaves one more hook on `embed_tokens` (2 per GRPO step measured with tiny-llama): after N steps every
embedding forward (each decoded token of every generation included) calls ~2N hooks, and their closures stay alive.
Found by tests/test_soak.py (tracemalloc, ~0.4 KiB per step; the time cost grows with the run: quadratic in total).

Fix: on each model that can register it, `enable_input_require_grads` first removes the hooks it registered
before, so at most one is alive. Cost: none (a list of handles walked once per generation).

Upstream: transformers 5.2x (pinned >=5.0,<6) with TRL 1.16 and peft's PeftModel. Remove when transformers'
disable side removes the hooks for a peft.PeftModel wrapper too: tests/test_soak.py then passes without it.
"""

from __future__ import annotations

import torch

from grpo_accel.core.model_access import causal_lm_of


def dedupe_input_require_grads(model: torch.nn.Module) -> int:
    """Make `enable_input_require_grads` idempotent on every PreTrainedModel inside `model` (a PeftModel, a
    DeepSpeed engine's module ...). Returns how many models were patched."""
    from transformers import PreTrainedModel

    patched = 0
    for module in model.modules():
        if not isinstance(module, PreTrainedModel) or "enable_input_require_grads" in module.__dict__:
            continue
        original = type(module).enable_input_require_grads

        def enable(module=module, original=original):
            module.disable_input_require_grads()  # the handles the last call registered: removed, not orphaned
            original(module)

        module.enable_input_require_grads = enable
        patched += 1
    return patched


def input_embedding_hooks(model: torch.nn.Module) -> int:
    """Forward hooks on the input embeddings (what the fix bounds; the soak test reads it per step)."""
    base = causal_lm_of(model)
    return len(base.get_input_embeddings()._forward_hooks)
