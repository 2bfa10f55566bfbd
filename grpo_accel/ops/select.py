"""The fused log-prob head's one entry: `token_logprobs(..., impl=...)` picks the reference, the chunked torch path
(logprobs.py) or the Triton folds (logprobs_triton.py). Its own module so that neither implementation imports the
other's dispatcher: logprobs_triton.py builds on logprobs.py's blocks, and only this module knows both."""

from __future__ import annotations

import torch

from grpo_accel.ops.logprobs import chunked_logprobs, logprobs_reference


def triton_usable(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def token_logprobs(hidden, weight, targets, *, impl="auto", temperature=1.0, softcap=None, ignore_index=-100,
                   compute_entropy=False, chunk_size=None, vocab_tile=None, weight_ctx=None):
    """Per-token log p(target) [...] and entropy [...] (or None) for hidden [..., H], targets [...].

    impl: "auto" (triton on CUDA when importable, else chunked) | "chunked" | "triton" | "reference".
    """
    lead = targets.shape
    h2, t2 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if impl == "auto":
        impl = "triton" if triton_usable(hidden.device) else "chunked"
    if impl == "reference":
        logp, ent = logprobs_reference(h2, weight, t2, temperature, softcap, ignore_index)
        ent = ent if compute_entropy else None
    elif impl in ("chunked", "triton"):
        if impl == "triton":
            from grpo_accel.ops.logprobs_triton import triton_logprobs as fn  # ImportError names the fix
        else:
            fn = chunked_logprobs
        logp, ent = fn(h2, weight, t2, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                       compute_entropy=compute_entropy, chunk_size=chunk_size, vocab_tile=vocab_tile,
                       weight_ctx=weight_ctx)
    else:
        raise ValueError(f"impl={impl!r}: choose one of 'auto', 'chunked', 'triton', 'reference'")
    return logp.view(lead), (ent.view(lead) if ent is not None else None)
