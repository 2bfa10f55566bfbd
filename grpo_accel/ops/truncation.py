"""The kept mass of truncated sampling: log Z per token, Z = the probability the full tempered distribution puts on the
tokens top_k / top_p / min_p keep (the sampler's support), without the [N, V] logits.

Same as `(z := softcap(hidden @ weight.T) / T).masked_fill(~kept_mask(z, truncation), -inf).logsumexp(-1)
- z.logsumexp(-1)` with the logits built one row chunk at a time ([chunk, V], no grad).

Why: a sampler that truncates reports the log-prob of the truncated, renormalised distribution (vLLM's
`processed_logprobs`, transformers' continuous batching with `return_logprobs`): log q(y) - log Z below the full
tempered log-prob the trainer scores. TRL's importance ratio exp(old - behaviour) then sits at Z instead of 1
on-policy. Adding log Z (the trainer's own Z, from the old-policy logits, support chosen by the sampler's rule) puts
the behaviour log-prob on the trainer's distribution (docs/off-policy-rollouts.md, "Truncated sampling").

    log_z = log_kept_mass(hidden, lm_head.weight, Truncation(top_p=0.9), temperature=0.7)   # [N] fp32

The support rule is the sampler's own, in its order (both keep at least the most probable token; ties at the top-k
threshold are kept):
  vLLM 0.32 (v1/sample/sampler.py): temperature, min_p (p < min_p * max p removed), then top_k, then top_p over the
    renormalised survivors (ascending cumulative sum <= 1 - top_p removed).
  transformers 5.24 (generation/utils.py `_get_logits_processor`, also its continuous batching): temperature,
    top_k, top_p, then min_p.
min_p last or first only matters through top_p: top_p's cut is taken on the distribution left before it.
Cost: one [chunk, H] x [H, V] GEMM per row chunk again (the head's old pass computed the same logits in tiles and
dropped them) and, with top_p, a sort of each row's V logits: run only while truncation is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_accel.ops.logprobs import block_budget_bytes, gemm_operand, logits_block


@dataclass(frozen=True)
class Truncation:
    """A sampler's truncation: top_k 0 is off, top_p 1.0 is off, min_p 0.0 is off; `min_p_first`: the sampler
    applies min_p before top_k / top_p (vLLM) rather than after them (transformers)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_p_first: bool = True

    @property
    def on(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _min_p(z: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = z.softmax(-1)  # -inf (already removed) -> 0, as both samplers compute it
    return probs >= min_p * probs.amax(-1, keepdim=True)


def _top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    return z >= z.topk(min(k, z.size(-1)), dim=-1).values[..., -1:]


def _top_p(z: torch.Tensor, p: float) -> torch.Tensor:
    ascending, order = z.sort(-1)
    removed = ascending.softmax(-1).cumsum(-1) <= 1 - p
    removed[..., -1] = False  # the most probable token stays
    return ~removed.scatter(-1, order, removed)


def kept_mask(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """[R, V] bool: the tokens the sampler may draw from tempered logits `z` [R, V] (the module docstring's rule)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    steps = [("top_k", truncation.top_k > 0, _top_k, truncation.top_k),
             ("top_p", truncation.top_p < 1.0, _top_p, truncation.top_p)]
    min_p = ("min_p", truncation.min_p > 0.0, _min_p, truncation.min_p)
    for _, active, rule, value in ([min_p, *steps] if truncation.min_p_first else [*steps, min_p]):
        if active:
            keep &= rule(z.masked_fill(~keep, float("-inf")), value)
    return keep


def _tempered(logits: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor:
    if softcap is not None:  # HF order, as the fused head: the model softcaps, the sampler divides by T
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def _log_kept_mass_of(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    kept = z.masked_fill(~kept_mask(z, truncation), float("-inf"))
    return kept.logsumexp(-1) - z.logsumexp(-1)


def log_kept_mass_reference(hidden, weight, truncation: Truncation, temperature=1.0, softcap=None):
    """The spec: full [N, V] logits in fp32 (fp64 if an input is fp64) -> log Z [N]."""
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    return _log_kept_mass_of(_tempered(hidden.to(acc) @ weight.to(acc).T, temperature, softcap), truncation)


# bytes per logit a row chunk holds at once: the logits, their sorted copy and its int64 order, the softmax / cumsum,
# two masks; a row of Llama-3's 128K vocabulary is ~3.5 MiB, so a CPU chunk (32 MiB) is ~9 rows, a CUDA one ~290
_BYTES_PER_LOGIT = 28


@torch.no_grad()
def log_kept_mass(hidden, weight, truncation: Truncation, *, temperature=1.0, softcap=None, chunk_size=None):
    """log Z [N] (fp32; fp64 for fp64 inputs) for hidden [N, H], weight [V, H]; 0 where truncation is off. Rows go
    `chunk_size` at a time (default: as many [chunk, V] blocks as the head's block budget holds), GEMM operands in the
    head's dtype rule (autocast's when on), everything after in fp32."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    out = torch.zeros(n, dtype=acc, device=hidden.device)
    if not truncation.on or n == 0:
        return out
    dev = hidden.device.type
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(dev) and cdt != torch.float64:
        cdt = torch.get_autocast_dtype(dev)
    chunk = chunk_size or max(1, block_budget_bytes(hidden.device) // (v * _BYTES_PER_LOGIT))
    # one operand copy of the whole head where the GEMM needs it (CPU with a bf16 head: V x H in fp32)
    w = gemm_operand(weight, acc, cdt)
    with torch.autocast(dev, enabled=False):
        for r0 in range(0, n, chunk):
            h = gemm_operand(hidden[r0:r0 + chunk], acc, cdt)
            logits = torch.empty(h.shape[0], v, dtype=acc, device=hidden.device)
            logits_block(logits, h, w, acc)  # fp32 logits, as the head's blocks (CUDA bf16: fp32 out)
            out[r0:r0 + chunk] = _log_kept_mass_of(_tempered(logits, temperature, softcap), truncation)
    return out


__all__ = ["Truncation", "kept_mask", "log_kept_mass", "log_kept_mass_reference"]
