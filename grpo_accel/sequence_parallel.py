"""Ulysses sequence parallelism for the policy / old / reference log-prob passes (DeepSpeed's `ulysses_sp`).

Naive equivalent: `model(input_ids=row)` on one process, the whole row's activations on one GPU. Here the SP group
(`sequence_parallel_size` consecutive ranks) splits each row along T: rank r runs the model on tokens
[r·T/sp, (r+1)·T/sp) with their global position ids; everything in a layer but attention is token-local, and
attention goes through DeepSpeed's `UlyssesSPAttentionHF`: an all-to-all turns [T/sp tokens, all heads] into
[all T tokens, heads/sp], the core attention (SDPA, causal) runs on whole sequences, a second all-to-all turns it
back. The head scores each rank's tokens against targets shifted *before* the split (the last token of shard r
predicts the first of shard r+1), and the per-token log-probs are all-gathered.

Data stay data-parallel: every rank generates and scores its own rows as in plain TRL; in each log-prob pass the
group exchanges its rows (real tokens only) and runs all of them in one forward (each parameter used once, so
DDP / ZeRO reduce its gradient once), each rank keeping the log-probs of its own rows in TRL's [B, logits_to_keep]
layout. So TRL's sampler, generation, loss and normalisation are untouched, and the gradients are data-parallel
ones: the gather's backward sums the group's gradients (each rank's loss reaches only its own rows) and keeps this
rank's slice; the engine's mean over all ranks gives mean_r d(loss_r), as without SP.
What that layout costs: each rank runs sp·B rows of T/sp tokens per pass, as many tokens as B whole rows, so SP
here shortens rows (row groups instead of sequence tiles in the re-run, attention over heads/sp) but does not cut
activation bytes per GPU. Cutting them needs a group-shared layout (one sequence per SP group: the sampler over
world/sp data-parallel ranks, completions generated once per group), which this module does not do yet.

Rows are unpadded first (TRL left-pads prompts, right-pads completions; Ulysses discards masks and attends
causally) and padded at their end to sp·L, L the longest row's shard; causal attention never lets a real token see
that padding.

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

from .head import backbone_hidden, causal_lm_of, score_hidden
from .offload import tiled

_CORES = ("sdpa", "grpo_accel_sdpa")  # stock SDPA, or packing.py's (stock SDPA on unpacked calls)
# forward kwarg carried to every attention call (and bound into the checkpoint's re-run): this call is one shard
SP_KWARG = "accel_sp"


class _GatherSeq(torch.autograd.Function):
    """[B, L] shards -> [B, sp·L] in rank order; backward: the full gradient summed over the group (each rank's loss
    reaches its own rows only), this rank's slice. An all-reduce of B·sp·L floats: nothing next to the all-to-alls."""

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


def enable(trainer, sp: int) -> SequenceParallel | None:
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
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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
            self._batch(query.shape[0])  # the rows of this call (all the group's, or a re-run's row group)
            return self.uattn(module, query, key, value, None, *args, **kwargs)  # causal; masks are per shard

        ALL_ATTENTION_FUNCTIONS[core] = attention  # replaces plain SDPA (and accelerate's wrapper, if any)
        for m in models:
            _install_sp_head(m, temperature=temperature, impl=impl, chunk_size=chunk_size, vocab_tile=vocab_tile,
                             offload=offload)

    def _batch(self, rows: int) -> None:
        """DeepSpeed's module checks a fixed batch size; ours varies per call (the sequence length already may)."""
        u = self.uattn
        u.batch_size = rows
        for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
            shape = getattr(u, name)
            setattr(u, name, torch.Size([shape[0], rows, *shape[2:]]))

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool,
                            autocast=contextlib.nullcontext):
        """TRL's hook's result for this rank's rows, ([B, logits_to_keep] log-probs, entropies or None). The group
        runs every rank's rows in one forward (each parameter used once: DDP / ZeRO reduce its grad once), every
        row padded at its end to the longest, split into sp shards; trailing padding is never attended (causal)."""
        B, T = input_ids.shape
        K, sp = logits_to_keep, self.sp
        mine, c0s = [], []
        for i in range(B):
            real = attention_mask[i].nonzero().flatten()
            if real.numel() == 0 or real[-1] - real[0] + 1 != real.numel():
                raise ValueError("sequence parallelism needs each row's real tokens in one block (TRL's layout)")
            start = int(real[0])
            mine.append(input_ids[i, start:start + real.numel()])
            c0s.append(T - K - start)  # index, in the row's real tokens, of its first completion token
        by_rank = self._gather_rows(mine, c0s)
        first = sum(len(r) for r in by_rank[:self.rank])
        rows = [row for r in by_rank for row in r]
        L = -(-max(ids.numel() for ids, _ in rows) // sp)  # shard length
        ids = input_ids.new_zeros(len(rows), sp * L)
        tgt = torch.full_like(ids, -100)
        for j, (row, c0) in enumerate(rows):  # position k scores token k+1 where k+1 >= c0 (TRL's window)
            ids[j, :row.numel()] = row
            tgt[j, max(c0 - 1, 0):row.numel() - 1] = row[max(c0, 1):]
        sl = slice(self.rank * L, (self.rank + 1) * L)
        pos = torch.arange(sl.start, sl.stop, device=ids.device).expand(len(rows), L)
        with autocast(), tiled.tiles_off():
            out = model(input_ids=ids[:, sl], position_ids=pos, accel_sp_targets=tgt[:, sl],
                        accel_entropy=compute_entropy, **{SP_KWARG: True})
        own = slice(first, first + B)
        lp = _GatherSeq.apply(out.log_probs, self.group)[own]
        # entropies carry no gradient (TRL logs them and masks by them): gathered outside autograd
        ent = _GatherSeq.apply(out.entropy.detach(), self.group)[own] if compute_entropy else None
        src = torch.arange(K, device=ids.device) + torch.tensor(c0s, device=ids.device)[:, None] - 1  # [B, K]
        valid = attention_mask[:, T - K:].bool() & (src >= 0)
        place = lambda x: torch.where(valid, x.gather(1, src.clamp(0, x.shape[1] - 1)), x.new_zeros(()))  # noqa
        return place(lp), (place(ent) if compute_entropy else None)

    def _gather_rows(self, rows, c0s):
        """Every rank's (real token ids, c0) rows, by rank: two small all-gathers (counts and lengths), one of ids."""
        dev, sp = rows[0].device, self.sp
        meta = torch.tensor([[r.numel(), c] for r, c in zip(rows, c0s)], dtype=torch.long, device=dev)
        count = torch.tensor([len(rows)], device=dev)
        counts = [torch.zeros_like(count) for _ in range(sp)]
        dist.all_gather(counts, count, group=self.group)
        most = int(max(counts))
        metas = [meta.new_zeros(most, 2) for _ in range(sp)]
        dist.all_gather(metas, torch.cat([meta, meta.new_zeros(most - len(rows), 2)]), group=self.group)
        longest = int(max(m[:, 0].max() for m in metas))
        ids = rows[0].new_zeros(most, longest)
        for i, r in enumerate(rows):
            ids[i, :r.numel()] = r
        all_ids = [torch.empty_like(ids) for _ in range(sp)]
        dist.all_gather(all_ids, ids, group=self.group)
        return [[(all_ids[r][i, :int(metas[r][i, 0])], int(metas[r][i, 1])) for i in range(int(counts[r]))]
                for r in range(sp)]


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
        hidden = backbone_hidden(causal_lm, args, kwargs)  # no shift: the targets are aligned with the positions
        return score_hidden(causal_lm, hidden, accel_sp_targets, impl=impl, temperature=temperature,
                            softcap=softcap, compute_entropy=accel_entropy, chunk_size=chunk_size,
                            vocab_tile=vocab_tile, offload=offload)

    forward.__wrapped__ = getattr(previous, "__wrapped__", previous)
    causal_lm.forward = forward
