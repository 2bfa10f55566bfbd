"""Ulysses sequence parallelism for the policy / old / reference log-prob passes (DeepSpeed's `ulysses_sp`).

Naive equivalent: `model(input_ids=row)` on one process, the whole row's activations on one GPU. Here the SP group
(`sequence_parallel_size` ranks holding the same batch) splits each row along T: rank r runs the model on tokens
[r·T/sp, (r+1)·T/sp) with their global position ids; everything in a layer but attention is token-local, and
attention goes through DeepSpeed's `UlyssesSPAttentionHF`: an all-to-all turns [T/sp tokens, all heads] into
[all T tokens, heads/sp], the core attention (SDPA, causal) runs on whole sequences, a second all-to-all turns it
back. The head scores each rank's tokens against targets shifted *before* the split (the last token of shard r
predicts the first of shard r+1), and the per-token log-probs are all-gathered into TRL's [B, logits_to_keep]
layout, so TRL's loss and its normalisation run unchanged, identically on every rank of the group.

Gradients: every rank computes the same loss on the gathered log-probs, so the gather's backward sums the
(identical) full gradients over the group and keeps this rank's slice: sp × its tokens' share. The engine's
data-parallel mean over all dp·sp ranks then gives each parameter the group's gradient (the sum over shards),
averaged over the dp groups, as without SP.

Rows are unpadded first (TRL left-pads prompts, right-pads completions; Ulysses discards masks and attends
causally) and padded at the end to a multiple of sp, which causal attention never lets a real token see.

Cost per layer: 4 all-to-alls of T/sp·(q + 2·kv + o dims) activations forward (again in backward and in the
checkpoint re-run); the core attention holds whole sequences of heads/sp heads. Needs: attention heads and kv
heads divisible by sp (or sp by kv heads), SDPA attention, our log-prob head (logprob_impl != "trl"). The layer
offload works on each shard; sequence tiles do not (a shard's attention needs the other ranks' keys): off.
Test: `OMP_NUM_THREADS=1 pytest tests/test_sequence_parallel.py` (2 CPU processes over gloo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .head import causal_lm_of, zero3_gather_ctx
from .offload import offload_saved_tensors, tiled
from .ops.logprobs import token_logprobs

_CORES = ("sdpa", "grpo_accel_sdpa")  # stock SDPA, or packing.py's (stock SDPA on unpacked calls)
# forward kwarg carried to every attention call (and bound into the checkpoint's re-run): this call is one shard
SP_KWARG = "accel_sp"


class _GatherSeq(torch.autograd.Function):
    """[B, L] shards -> [B, sp·L] in rank order; backward: the full gradient summed over the group, this rank's
    slice (an all-reduce of B·sp·L floats per pass: nothing next to the layers' all-to-alls)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.L = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[..., ctx.rank * ctx.L:(ctx.rank + 1) * ctx.L], None


def unsupported_reason(causal_lm, sp: int) -> str | None:
    cfg = causal_lm.config.get_text_config()
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % sp:
        return f"{heads} attention heads are not divisible by sequence_parallel_size={sp}"
    if kv % sp and sp % kv:
        return f"{kv} key/value heads and sequence_parallel_size={sp}: neither divides the other"
    if causal_lm.config._attn_implementation not in _CORES:
        return f"attn_implementation={causal_lm.config._attn_implementation!r} (Ulysses is wired here for 'sdpa')"
    return None


def enable(trainer, sp: int) -> "SequenceParallel | None":
    """Ulysses SP on a GRPOAccelTrainer whose log-prob head is installed; an error naming the fix otherwise. One
    process has nothing to split over: None, with one line (the presets' scaled-down CPU steps run that way)."""
    from .console import log
    from .errors import ConfigError

    if trainer.logprob_impl == "trl":
        raise ConfigError(f"--sequence_parallel_size {sp} needs grpo_accel's log-prob head. Fix: --logprob_impl auto.")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        log(f"sequence_parallel_size={sp} with one process: sequence parallelism off (launch {sp} processes)")
        return None
    if world % sp:
        raise ConfigError(f"--sequence_parallel_size {sp} must divide the {world} process(es). Fix: launch a "
                          f"multiple of {sp} processes (accelerate_configs/cpu_ulysses2.yaml: 2 over gloo).")
    reason = unsupported_reason(causal_lm_of(trainer.model), sp)
    if reason:
        raise ConfigError(f"--sequence_parallel_size {sp}: {reason}. Fix: --sequence_parallel_size 1.")
    log(f"sequence parallelism: Ulysses over {sp} processes for the log-prob passes")
    models = [m for m in (trainer.model, trainer.ref_model) if m is not None]
    off = trainer.offload_config if trainer.offload_enabled else None
    return SequenceParallel(models, sp, temperature=trainer.temperature, impl=trainer.logprob_impl,
                            chunk_size=trainer.args.logprob_chunk_size, vocab_tile=trainer.args.logprob_vocab_tile,
                            offload=off)


class SequenceParallel:
    """Ulysses SP over the ranks of `group` (default: DeepSpeed's SP group of `sp` consecutive ranks, created here
    unless accelerate's ParallelismConfig already made it). `models`: the policy (and reference) models carrying
    our log-prob head; `head_kwargs`: as `install_logprob_head`'s."""

    def __init__(self, models, sp: int, *, temperature: float, impl: str, chunk_size=None, vocab_tile=None,
                 offload=None, group=None):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        import deepspeed

        if not deepspeed.comm.is_initialized():  # Ulysses talks through deepspeed.comm (accelerate + DeepSpeed did it)
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        if group is None:
            if mpu._SEQUENCE_PARALLEL_GROUP is None:  # else accelerate (ParallelismConfig sp_size) made it
                mpu.initialize_sequence_parallel(sp)
            group = mpu.get_sequence_parallel_group()
        if dist.get_world_size(group) != sp:
            raise ValueError(f"sequence_parallel_size={sp} but the SP group has {dist.get_world_size(group)} ranks")
        self.sp, self.group, self.rank = sp, group, dist.get_rank(group)
        cfg = causal_lm_of(models[0]).config.get_text_config()
        self.uattn = UlyssesSPAttentionHF(
            attn=sdpa_attention_forward, batch_size=1, attn_head_count=cfg.num_attention_heads,
            attn_head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            kv_head_count=cfg.num_key_value_heads, num_hidden_layers=cfg.num_hidden_layers, process_group=group,
            seq_length_is_variable=True)
        self.uattn.core_attn_implementation = "sdpa"
        core = causal_lm_of(models[0]).config._attn_implementation
        plain = sdpa_attention_forward if core == "sdpa" else ALL_ATTENTION_FUNCTIONS[core]

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if not kwargs.pop(SP_KWARG, False):  # generation, evaluation: each rank holds whole rows
                return plain(module, query, key, value, attention_mask, *args, **kwargs)
            return self.uattn(module, query, key, value, None, *args, **kwargs)  # causal; masks are per shard

        ALL_ATTENTION_FUNCTIONS[core] = attention  # replaces plain SDPA (and accelerate's wrapper, if any)
        for m in models:
            _install_sp_head(m, temperature=temperature, impl=impl, chunk_size=chunk_size, vocab_tile=vocab_tile,
                             offload=offload)

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool,
                            autocast=contextlib.nullcontext):
        """TRL's hook's result, ([B, logits_to_keep] log-probs, entropies or None), one row per SP forward."""
        B, T = input_ids.shape
        K, sp = logits_to_keep, self.sp
        self._check_same_batch(input_ids, attention_mask)
        rows_lp, rows_ent = [], []
        for i in range(B):
            real = attention_mask[i].nonzero().flatten()
            if real.numel() == 0 or real[-1] - real[0] + 1 != real.numel():
                raise ValueError("sequence parallelism needs each row's real tokens in one block (TRL's layout)")
            start, n = int(real[0]), real.numel()
            L = -(-n // sp)  # shard length; the row is padded at the end to sp·L
            ids = input_ids.new_zeros(sp * L)
            ids[:n] = input_ids[i, start:start + n]
            # target of position k is token k+1, scored only where k+1 is a completion token (TRL's window)
            tgt = torch.full_like(ids, -100)
            k = torch.arange(n - 1, device=ids.device)
            keep = (start + k + 1) >= T - K
            tgt[k[keep]] = ids[k[keep] + 1]
            sl = slice(self.rank * L, (self.rank + 1) * L)
            pos = torch.arange(sl.start, sl.stop, device=ids.device)[None]
            with autocast(), tiled.tiles_off():
                out = model(input_ids=ids[None, sl], position_ids=pos, accel_sp_targets=tgt[None, sl],
                            accel_entropy=compute_entropy, **{SP_KWARG: True})
            cols = torch.arange(K, device=ids.device)
            src = T - K + cols - start - 1  # position in the unpadded row whose target is completion token col
            valid = attention_mask[i, T - K:].bool() & (src >= 0)
            rows_lp.append(_place(_GatherSeq.apply(out.log_probs, self.group)[0], src, valid, K))
            if compute_entropy:
                rows_ent.append(_place(_GatherSeq.apply(out.entropy, self.group)[0], src, valid, K))
        return torch.stack(rows_lp), (torch.stack(rows_ent) if compute_entropy else None)

    def _check_same_batch(self, input_ids, attention_mask) -> None:
        """Every rank of the group must hold the same rows (they run one sequence between them); a different batch
        would hang in the all-to-all or silently mix sequences. One all-reduce of 2 numbers per pass."""
        sig = torch.stack([(input_ids * attention_mask).sum(), torch.tensor(input_ids.numel())]).double()
        lo, hi = sig.clone(), sig.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(lo, hi):
            raise RuntimeError("sequence parallelism: the ranks of one SP group hold different batches; each group "
                               "must generate once and share its completions (launch with ParallelismConfig sp_size)")


def _place(full: torch.Tensor, src: torch.Tensor, valid: torch.Tensor, K: int) -> torch.Tensor:
    """[K] row of TRL's layout: full[src[j]] where valid, 0 elsewhere (as our head's masked positions)."""
    return torch.where(valid, full[src.clamp(0, full.numel() - 1)], full.new_zeros(()))


def _install_sp_head(model, *, temperature, impl, chunk_size, vocab_tile, offload) -> None:
    """A call with `accel_sp_targets` [B, L] (targets already aligned with the positions, -100 = unscored) runs the
    backbone on the shard and our head on every scored position: no shift inside the shard (the head's own
    `accel_labels` path shifts within the call and would lose the shard's last target)."""
    causal_lm = causal_lm_of(model)
    previous = causal_lm.forward
    softcap = getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None)

    def forward(*args, accel_sp_targets=None, accel_entropy=False, **kwargs):
        if accel_sp_targets is None:  # the head's calls (accel_labels) and everything else
            return previous(*args, accel_entropy=accel_entropy, **kwargs)
        from .head import HeadOutput

        kwargs["use_cache"] = False
        for key in ("labels", "return_dict", "logits_to_keep", "num_items_in_batch"):
            kwargs.pop(key, None)
        hidden = causal_lm.base_model(*args, **kwargs).last_hidden_state
        labels = accel_sp_targets.to(hidden.device)
        mask = labels != -100
        weight = causal_lm.get_output_embeddings().weight
        keep_on_host = (offload_saved_tensors(min_bytes=offload.min_bytes, config=offload) if offload is not None
                        else contextlib.nullcontext())
        with zero3_gather_ctx(weight), keep_on_host:
            logp, ent = token_logprobs(hidden[mask], weight, labels[mask], impl=impl, temperature=temperature,
                                       softcap=softcap, compute_entropy=accel_entropy, chunk_size=chunk_size,
                                       vocab_tile=vocab_tile, weight_ctx=lambda: zero3_gather_ctx(weight))
        scatter = lambda x: None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)  # noqa: E731
        return HeadOutput(log_probs=scatter(logp), entropy=scatter(ent))

    forward.__wrapped__ = getattr(previous, "__wrapped__", previous)
    causal_lm.forward = forward
