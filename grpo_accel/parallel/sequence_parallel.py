"""Ulysses sequence parallelism for the policy / old / reference log-prob passes (DeepSpeed's `ulysses_sp`).

Naive equivalent: `model(input_ids=row)` on one process, the whole row's activations on one GPU. Here the SP group
(`sequence_parallel_size` consecutive ranks) splits each row along T: rank r runs the model on tokens
[r·T/sp, (r+1)·T/sp) with their global position ids; everything in a layer but attention is token-local, and
attention goes through DeepSpeed's `UlyssesSPAttentionHF`: an all-to-all turns [T/sp tokens, all heads] into
[all T tokens, heads/sp], the core attention (SDPA, causal) runs on whole sequences, a second all-to-all turns it
back. The head scores each rank's tokens against targets shifted *before* the split (the last token of shard r
predicts the first of shard r+1), and the per-token log-probs are all-gathered.

The SP group is one data-parallel rank: its `sp` processes hold the same rows (group-shared layout), so each GPU
holds T/sp tokens of each row, and a micro-batch of one row puts T/sp tokens on each GPU. What makes the rows the
same (GRPOAccelTrainer wires it):
- `GroupSharedSampler`: TRL's sampler built for world/sp data-parallel ranks, each batch emitted sp times in a row;
  accelerate deals batch i to process i mod world, so the sp consecutive ranks of a group draw the same prompts.
- `generate_once`: each rank generates 1/sp of the group's prompts and the group all-gathers the results, so every
  completion is generated once (and generation runs sp-way parallel); then the group's RNG states are made equal
  (TRL's shuffle of the generation batch must permute the same way on every rank).
- Every rank computes the rewards and TRL's loss of the same rows (a reward function runs sp times per completion).
  TRL's cross-process gathers then see each row sp times: means are unchanged; the advantage groups stay right when
  each group's generation batch holds whole groups of num_generations (checked in GRPOAccelConfig); TRL's
  `num_items_in_batch` counts each token sp times and divides by world processes, i.e. by world/sp ranks: right.
- Gradients: every rank's loss is the group's loss, so its slice of d(log-probs) is exact (no sum over the group);
  each rank's parameter gradient is its shard's part of the group's gradient, and the data-parallel engine averages
  over world ranks where data parallelism has world/sp: `_GatherSeq` scales this rank's slice by sp to make up.
A check per pass (one all-gather of 4 integers) stops the run if the ranks of a group ever hold different rows.

Rows are unpadded first (TRL left-pads prompts, right-pads completions; Ulysses discards masks and attends
causally) and padded at their end to sp·L, L the longest row's shard; causal attention never lets a real token see
that padding.

Cost per layer: 4 all-to-alls of T/sp·(q + 2·kv + o dims) activations forward (again in backward and in the
checkpoint re-run); the core attention holds whole sequences of heads/sp heads. Needs: attention heads and kv
heads divisible by sp (or sp by kv heads), SDPA attention (gpt-oss: its eager attention, whose sinks each rank
takes for its own heads after the all-to-all, `_sink_core`), our log-prob head (logprob_impl != "trl"). The layer
offload works on each shard, and a shard longer than its re-run piece runs in sequence tiles whose attention
reaches the other ranks' keys (parallel/ulysses_tiles.py); with offload on, each layer's MLP also runs in tiles wherever
the layer runs whole (the no-grad passes; tiling/mlp.py).
Test: `OMP_NUM_THREADS=1 pytest tests/test_sequence_parallel.py` (2 CPU processes over gloo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from grpo_accel.core import rng as rng_state
from grpo_accel.core.model_access import causal_lm_of
from grpo_accel.core.patches import Patches, register
from grpo_accel.core.processes import group_size
from grpo_accel.head.logprob_head import install_logprob_head
from grpo_accel.parallel.ulysses_tiles import (  # the forward kwarg that marks each attention call of a shard
    SP_KWARG,
    UlyssesTiles,
)
from grpo_accel.tiling import layer as tiled
from grpo_accel.tiling import mlp as tiled_mlp
from grpo_accel.tiling.attention import attend_tile, with_sink_column

# a call with this kwarg ([B, L] targets aligned with the shard's positions, -100 = unscored) runs the backbone on
# the shard and our head on every scored position (the head installed again, without its next-token shift)
SP_TARGETS_KWARG = "accel_sp_targets"
_CORES = ("sdpa", "grpo_accel_sdpa")  # stock SDPA, or packing.py's (stock SDPA on unpacked calls)
SINK_MODELS = ("gpt_oss",)  # eager attention with sinks and sliding windows: `_sink_core` after the all-to-all


def _module_eager(module, *args, **kwargs):
    """The module's own eager attention (gpt-oss's handles its sinks), for calls Ulysses does not shard."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


class _GatherSeq(torch.autograd.Function):
    """[B, L] shards -> [B, sp·L] in rank order; backward: this rank's slice of the gradient, times sp. Every rank
    of the group computes the same loss from the same rows, so the slice is already the whole gradient there; the
    factor sp makes the engine's mean over world ranks the mean over world/sp data-parallel ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.sp, ctx.rank, ctx.L = dist.get_world_size(group), dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(ctx.sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.L:(ctx.rank + 1) * ctx.L] * ctx.sp, None


def _concat(parts):
    """One value from each rank's piece of TRL's `_generate` result, in rank order."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    return [x for p in parts for x in p]


class GroupSharedSampler(torch.utils.data.Sampler):
    """`base` (TRL's RepeatSampler for world/sp data-parallel ranks) with each run of `chunk` indices (one rank's
    dataloader batch) repeated `copies` = sp times: accelerate gives batch i to process i mod world, so the sp
    consecutive ranks of an SP group get the same batch, and the groups get what data-parallel ranks would."""

    def __init__(self, base, chunk: int, copies: int):
        self.base, self.chunk, self.copies = base, chunk, copies

    def __iter__(self):
        batch = []
        for index in self.base:
            batch.append(index)
            if len(batch) == self.chunk:
                for _ in range(self.copies):
                    yield from batch
                batch = []
        for _ in range(self.copies if batch else 0):
            yield from batch

    def __len__(self):
        return len(self.base) * self.copies


def unsupported_reason(config, sp: int, attn_implementation: str | None = None) -> str | None:
    """Why a model with this (HF) config cannot run Ulysses over `sp` ranks; None if it can. Read before the weights
    load (startup_checks) and again on the loaded model."""
    cfg = config.get_text_config()
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % sp:
        return f"{heads} attention heads are not divisible by sequence_parallel_size={sp}"
    if kv % sp and sp % kv:
        return f"{kv} key/value heads and sequence_parallel_size={sp}: neither divides the other"
    impl = attn_implementation or config._attn_implementation or "sdpa"
    if getattr(cfg, "model_type", None) in SINK_MODELS:
        return None if impl in ("eager", *_CORES) else f"attn_implementation={impl!r} on gpt-oss (eager here)"
    if impl not in _CORES:
        return f"attn_implementation={impl!r} (Ulysses is wired here for 'sdpa')"
    return None


def enable(sp: int, *, models, logprob_impl: str, train_dataset=None, temperature: float = 1.0, chunk_size=None,
           vocab_tile=None, offload=None) -> SequenceParallel | None:
    """Ulysses SP over `sp` processes for `models` (the policy, and the reference when there is one) carrying our
    log-prob head (`logprob_impl`, not "trl"); an error naming the fix otherwise. One process has nothing to split
    over: None, with one line (the presets' scaled-down CPU steps run that way). The trainer passes its own values
    (GRPOAccelTrainer.sequence_parallel_arguments): nothing here reads a trainer."""
    from grpo_accel.core.console import log
    from grpo_accel.core.errors import ConfigError

    if logprob_impl == "trl":
        raise ConfigError(f"--sequence_parallel_size {sp} needs grpo_accel's log-prob head. Fix: --logprob_impl auto.")
    world = group_size()
    if world == 1:
        log(f"sequence_parallel_size={sp} with one process: sequence parallelism off (launch {sp} processes)")
        return None
    if world % sp:
        raise ConfigError(f"--sequence_parallel_size {sp} must divide the {world} process(es). Fix: launch a "
                          f"multiple of {sp} processes (accelerate_configs/cpu_ulysses2.yaml: 2 over gloo).")
    reason = unsupported_reason(causal_lm_of(models[0]).config, sp)
    if reason:
        raise ConfigError(f"--sequence_parallel_size {sp}: {reason}. Fix: --sequence_parallel_size 1.")
    import datasets

    if isinstance(train_dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset)):
        raise ConfigError(f"--sequence_parallel_size {sp} deals batches to SP groups through TRL's sampler, which a "
                          f"streaming (iterable) dataset does not use. Fix: a map-style dataset (streaming off).")
    log(f"sequence parallelism: Ulysses over {sp} processes (each group of {sp} shares its rows, "
        f"{world // sp} data-parallel group(s))")
    return SequenceParallel([m for m in models if m is not None], sp, temperature=temperature, impl=logprob_impl,
                            chunk_size=chunk_size, vocab_tile=vocab_tile, offload=offload)


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
        sinks = getattr(cfg, "model_type", None) in SINK_MODELS
        self.uattn = UlyssesSPAttentionHF(
            attn=self._sink_core if sinks else sdpa_attention_forward, batch_size=1,
            attn_head_count=cfg.num_attention_heads,
            attn_head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            kv_head_count=cfg.num_key_value_heads, num_hidden_layers=cfg.num_hidden_layers, process_group=group,
            seq_length_is_variable=True)
        self.uattn.core_attn_implementation = "sdpa"
        core = causal_lm_of(models[0]).config._attn_implementation
        plain = (sdpa_attention_forward if core == "sdpa" else _module_eager if core == "eager"
                 else ALL_ATTENTION_FUNCTIONS[core])

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if not kwargs.pop(SP_KWARG, False):  # generation, evaluation: each rank holds whole rows
                return plain(module, query, key, value, attention_mask, *args, **kwargs)
            self._batch(query.shape[0])  # the rows of this call (all the group's, or a re-run's row group)
            return self.uattn(module, query, key, value, None, *args, **kwargs)  # causal; masks are per shard

        # Replaces plain SDPA (and accelerate's wrapper, if any) for every model of the process, until `remove()`:
        # calls without SP_KWARG go to `plain`, so other models see stock SDPA meanwhile.
        self.patches = Patches()
        self.patches.add(register(ALL_ATTENTION_FUNCTIONS._local_mapping, core, attention))
        for m in models:
            self.patches.add(install_logprob_head(m, labels_kwarg=SP_TARGETS_KWARG, shift=False,
                                                  temperature=temperature, impl=impl, chunk_size=chunk_size,
                                                  vocab_tile=vocab_tile, offload=offload))
            if offload is not None and offload.recompute_tokens:  # the long-sequence setup: MLP in sequence tiles
                tiled_mlp.install(m, offload.recompute_tokens)
                self.patches.add(lambda m=m: tiled_mlp.uninstall(m))

    def _sink_core(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """gpt-oss's attention on whole sequences of this rank's heads after Ulysses' all-to-all: its sinks sharded
        with their heads (rank r holds query heads [r·H/sp, (r+1)·H/sp), so the sinks of those), sliding windows
        as they are (positions are whole again), through tiling/attention.py's sink key. d(sinks) of a rank's heads
        comes from that rank alone, as each rank's share of the other parameters' gradients does."""
        sinks = kwargs.get("s_aux")
        heads = query.shape[1]
        if sinks is not None:
            query = with_sink_column(query, sinks[self.rank * heads:(self.rank + 1) * heads], scaling)
        out = attend_tile(query, key, value, None, 0, dropout, scaling, None, kwargs.get("sliding_window"),
                      sinks is not None)
        return out.transpose(1, 2), None

    def remove(self) -> None:
        """Undo what __init__ patched (the attention registry, the models' forwards); the SP group stays."""
        self.patches.undo()

    def _batch(self, rows: int) -> None:
        """DeepSpeed's module checks a fixed batch size; ours varies per call (the sequence length already may)."""
        u = self.uattn
        u.batch_size = rows
        for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
            shape = getattr(u, name)
            setattr(u, name, torch.Size([shape[0], rows, *shape[2:]]))

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool,
                            autocast=contextlib.nullcontext):
        """TRL's hook's result for the group's rows, ([B, logits_to_keep] log-probs, entropies or None), on every rank
        of the group: each row padded at its end to sp·L, this rank runs tokens [rank·L, (rank+1)·L) of every row
        and the group all-gathers the per-token results; trailing padding is never attended (causal)."""
        B, T = input_ids.shape
        K, sp = logits_to_keep, self.sp
        self._check_same_rows(input_ids, attention_mask)
        rows, c0s = [], []
        for i in range(B):
            real = attention_mask[i].nonzero().flatten()
            if real.numel() == 0 or real[-1] - real[0] + 1 != real.numel():
                raise ValueError("sequence parallelism needs each row's real tokens in one block (TRL's layout)")
            start = int(real[0])
            rows.append(input_ids[i, start:start + real.numel()])
            c0s.append(T - K - start)  # index, in the row's real tokens, of its first completion token
        L = -(-max(row.numel() for row in rows) // sp)  # shard length
        ids = input_ids.new_zeros(B, sp * L)
        tgt = torch.full_like(ids, -100)
        for j, (row, c0) in enumerate(zip(rows, c0s)):  # position k scores token k+1 where k+1 >= c0 (TRL's window)
            ids[j, :row.numel()] = row
            tgt[j, max(c0 - 1, 0):row.numel() - 1] = row[max(c0, 1):]
        sl = slice(self.rank * L, (self.rank + 1) * L)
        pos = torch.arange(sl.start, sl.stop, device=ids.device).expand(B, L)
        with autocast(), tiled.shard_tiles(UlyssesTiles(self.group)):
            out = model(input_ids=ids[:, sl], position_ids=pos, **{SP_TARGETS_KWARG: tgt[:, sl]},
                        accel_entropy=compute_entropy, **{SP_KWARG: True})
        lp = _GatherSeq.apply(out.log_probs, self.group)
        # entropies carry no gradient (TRL logs them and masks by them): gathered outside autograd
        ent = _GatherSeq.apply(out.entropy.detach(), self.group) if compute_entropy else None
        src = torch.arange(K, device=ids.device) + torch.tensor(c0s, device=ids.device)[:, None] - 1  # [B, K]
        valid = attention_mask[:, T - K:].bool() & (src >= 0)
        place = lambda x: torch.where(valid, x.gather(1, src.clamp(0, x.shape[1] - 1)), x.new_zeros(()))  # noqa
        return place(lp), (place(ent) if compute_entropy else None)

    def _check_same_rows(self, input_ids, attention_mask) -> None:
        """The group-shared layout's invariant, checked on every pass: 4 integers all-gathered (a weighted checksum
        wraps around in int64 the same way on every rank)."""
        T = input_ids.shape[1]
        w = torch.arange(1, T + 1, device=input_ids.device) * 31 + 7
        rows = torch.arange(1, input_ids.shape[0] + 1, device=input_ids.device)
        sig = torch.stack([torch.tensor(input_ids.shape, device=input_ids.device).prod(),
                           torch.tensor(T, device=input_ids.device),
                           ((input_ids.long() * w).sum(1) * rows).sum(),
                           ((attention_mask.long() * w).sum(1) * rows).sum()])
        sigs = [torch.empty_like(sig) for _ in range(self.sp)]
        dist.all_gather(sigs, sig, group=self.group)
        if any(not torch.equal(s, sigs[0]) for s in sigs):
            raise RuntimeError("sequence parallelism: the ranks of one SP group hold different rows, so their shards "
                               "are not one sequence (GroupSharedSampler and generate_once make them equal in "
                               "training; TRL's evaluation loop is not wired for SP)")

    def generate_once(self, generate, prompts):
        """TRL's `_generate(prompts)` for the group's prompts (the same on every rank): this rank generates its 1/sp
        of them, the group all-gathers the pieces; then every rank takes the group leader's RNG state, so what
        follows (TRL's shuffle of the generation batch, dropout on the shards) draws the same on every rank.
        Sampling draws from this rank's own stream, which the group's shared state must not replace: the ranks of
        a group each sample a copy of the same prompt (G copies per group), and from one state they would sample the
        same completion. So each rank keeps its generation stream (started from its TRL seed, seed + process index)
        aside between calls: its completions are those of one process with that seed generating its pieces."""
        k, rem = divmod(len(prompts), self.sp)
        if rem:
            raise ValueError(f"{len(prompts)} prompts do not split over sequence_parallel_size={self.sp}")
        own = getattr(self, "_generation_rng", None)
        if own is not None:
            rng_state.restore(own)
        piece = generate(prompts[self.rank * k:(self.rank + 1) * k])
        self._generation_rng = rng_state.capture()
        pieces = [None] * self.sp
        dist.all_gather_object(pieces, piece, group=self.group)
        self._sync_rng()
        return tuple(_concat([p[i] for p in pieces]) for i in range(len(piece)))

    def _sync_rng(self) -> None:
        states = [rng_state.capture()]
        dist.broadcast_object_list(states, src=dist.get_global_rank(self.group, 0), group=self.group)
        rng_state.restore(states[0])
