"""The policy, old-policy and reference log-prob passes behind GRPOAccelTrainer's one TRL hook
(`_get_per_token_logps_and_entropies`): padded mini-batches through our fused head, packed rows of real tokens (the
shared-prompt layout where a group pays), Ulysses SP's shards, or TRL's own code where ours does not apply (its head,
its router loss under SP, multimodal inputs). Functions of the trainer: they read its savers' state (offload config,
packing, share_prompt) and count the tokens each layout ran (share_prompt/token_ratio).
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from grpo_accel.core.console import log
from grpo_accel.core.model_access import causal_lm_of
from grpo_accel.core.processes import several_processes
from grpo_accel.core.settings import setting
from grpo_accel.head.router_loss import load_balancing_loss, token_weights
from grpo_accel.head.routing_replay import ROUTING_KWARG, ForwardRouting
from grpo_accel.parallel.packing import (
    ATTN_NAME,
    SEGMENTS_KWARG,
    default_token_budget,
    pack_rows,
    packable_lengths,
    packed_forward_context,
    plan_micro_batches,
    split_to_count,
    unpack,
)
from grpo_accel.parallel.shared_prompt import pack_units, prompt_units, split_units_to_count


class PackedPasses:
    """What the packed log-prob passes did, owned by the trainer (`packed_passes`): tokens they ran and would have run
    without the shared prompt since the last log (`pop_token_ratio`: share_prompt/token_ratio), and whether the
    padded fallback was said (once)."""

    def __init__(self):
        self.ran = self.unshared = 0
        self.fallback_said = False

    def pop_token_ratio(self) -> float | None:
        """ran / unshared since the last call (1.0: nothing shared; None: no packed pass ran)."""
        ratio = self.ran / self.unshared if self.unshared else None
        self.ran = self.unshared = 0
        return ratio


def logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                        compute_entropy, compute_aux_loss, truncation=None, **multimodal):
    """(logps, entropies, aux) of TRL's hook; with `truncation` (a Truncation that is on: the old pass of a run whose
    sampler truncates) a fourth, log Z of its support at each completion position (None where the pass is not our
    head's: TRL's head, its router loss, multimodal inputs, SP)."""
    batch_size = setting(trainer.args, "logprob_mini_batch") or batch_size or input_ids.size(0)
    multimodal_inputs = any(v is not None for v in multimodal.values())
    trl_head = trainer.logprob_impl == "trl"
    sequence_parallel = getattr(trainer, "sequence_parallel", None)
    # a MoE's router loss (compute_aux_loss) is ours to return on our head's paths (head/router_loss.py)
    theirs_aux = compute_aux_loss and (trl_head or sequence_parallel is not None)
    theirs = trl_head or theirs_aux or multimodal_inputs
    kept = {} if truncation is None or theirs or sequence_parallel is not None else {"accel_kept_mass": truncation}
    out = None
    if trainer.padding_free and sequence_parallel is None and not (theirs_aux or multimodal_inputs):
        out = packed_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                         compute_entropy, trl_head, compute_aux_loss, kept)
    if out is None and theirs:
        out = (*GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            **multimodal), None)
    elif out is None and sequence_parallel is not None:
        out = (*sequence_parallel.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                      compute_entropy, trainer.accelerator.autocast), None, None)
    elif out is None:
        out = padded_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                         compute_entropy, compute_aux_loss, kept)
    return out if truncation is not None else out[:3]


def padded_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                               compute_entropy, compute_aux_loss, kept):
    """Our head over padded mini-batches of `batch_size` rows: (logps, entropies, aux, log Z or None); `kept`: the
    head's kept-mass kwarg, or {}."""
    all_logps, all_entropies, all_kept, routers = [], [], [], []
    router = {"output_router_logits": True} if compute_aux_loss else {}
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        # Only the completion tokens are scored (same labels as TRL's hook)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        with trainer.accelerator.autocast():
            out = model(input_ids=ids, attention_mask=mask, accel_labels=labels, accel_entropy=compute_entropy,
                        **router, **kept, **routing_kwargs(trainer, ids, mask))
        all_logps.append(out.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            all_entropies.append(out.entropy[:, -logits_to_keep:])
        if kept:
            all_kept.append(out.log_kept_mass[:, -logits_to_keep:])
        if compute_aux_loss:
            routers.append((out.router_logits, mask.reshape(-1).float()))
    entropies = torch.cat(all_entropies) if compute_entropy else None
    aux = load_balancing_loss(causal_lm_of(model), routers) if compute_aux_loss else None
    return torch.cat(all_logps), entropies, aux, (torch.cat(all_kept) if kept else None)


def routing_kwargs(trainer, input_ids, attention_mask) -> dict:
    """The model keyword that hands a forward its rows' recorded routing (head/routing_replay.py), {} where there is
    none: a dense model, replay off and nothing to measure, no row with a record."""
    records, replay = getattr(trainer, "routing_records", None), getattr(trainer, "routing_replay", None)
    routing = records.for_rows(input_ids, attention_mask) if records is not None else None
    return {} if routing is None else {ROUTING_KWARG: ForwardRouting(routing.to(input_ids.device), replay.replaying)}


def packed_routing(recorded: dict, attention_mask, rows: list[int], n_tokens: int) -> dict:
    """The padded rows' routing packed as pack_rows packs their tokens (real tokens, row-major), [1, N, L, k]."""
    routing = recorded[ROUTING_KWARG]
    idx = torch.tensor(rows, device=routing.indices.device)
    packed = routing.indices[idx][attention_mask[idx].bool().to(idx.device)]
    if packed.size(0) != n_tokens:  # pack_rows pairs a lone token with a copy of itself
        packed = packed.repeat(n_tokens // packed.size(0), 1, 1)
    return {ROUTING_KWARG: ForwardRouting(packed[None], replay=routing.replay)}


def packed_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, rows_per_forward,
                               compute_entropy, trl_head=False, compute_aux_loss=False, kept=None):
    """As the padded loop (its four results), one packed row of real tokens per forward, <= logprob_token_budget
    tokens each, through our head or TRL's (`trl_head`: same label shift, same [1, N-1] outputs; not with
    `compute_aux_loss`, the MoE router loss, taken over all forwards: head/router_loss.py); None (padded) when a
    row's tokens are not one block. `kept`: the head's kept-mass kwarg, or {} (never with TRL's head)."""
    lengths, ok = packable_lengths(attention_mask)
    recompute_tokens = trainer.offload_config.recompute_tokens if trainer.offload_enabled else None
    budget = (setting(trainer.args, "logprob_token_budget")
              or default_token_budget(rows_per_forward, input_ids.size(1), recompute_tokens))
    # `model` may be a DeepSpeed engine / DDP wrapper here (whose .config is not the model's)
    segment_kwarg = causal_lm_of(model).config._attn_implementation == ATTN_NAME
    units = None  # the shared-prompt layout's forwards (shared_prompt.py), when a group of this batch pays
    recorded = routing_kwargs(trainer, input_ids, attention_mask)  # the shared prompt's layout does not carry it yet
    if ok and segment_kwarg and getattr(trainer, "share_prompt", "false") != "false" and not recorded:
        units, prompt_lens = prompt_units(input_ids, attention_mask, logits_to_keep, trainer.share_prompt)
        if not any(u.share for u in units):
            units = None
    if units is not None:
        costs = [u.tokens(prompt_lens[u.rows[0]], lengths) for u in units]
        trainer.packed_passes.ran += sum(costs)
        groups = [[units[i] for i in g] for g in plan_micro_batches(costs, budget)]
    else:
        groups = plan_micro_batches(lengths, budget) if ok else []
        trainer.packed_passes.ran += sum(lengths)
    trainer.packed_passes.unshared += sum(lengths)
    if several_processes():  # same forwards on every rank: see split_to_count
        plan = torch.tensor([len(groups), int(not ok)], device=trainer.accelerator.device)
        torch.distributed.all_reduce(plan, op=torch.distributed.ReduceOp.MAX)
        ok = ok and not plan[1]
        split = split_units_to_count if units is not None else split_to_count
        groups = split(groups, int(plan[0])) if ok else []
    if not ok:
        if not trainer.packed_passes.fallback_said:
            log("padding_free: a batch has a row whose attention mask has holes or no tokens; it runs padded.")
            trainer.packed_passes.fallback_said = True
        return None
    outs, routers = [], []
    for group in groups:
        p = (pack_units(input_ids, attention_mask, logits_to_keep, group) if units is not None
             else pack_rows(input_ids, attention_mask, logits_to_keep, group))
        extra = {SEGMENTS_KWARG: p.segments} if segment_kwarg else {}
        if recorded:
            extra.update(packed_routing(recorded, attention_mask, group, p.input_ids.size(1)))
        extra.update(dict(labels=p.labels, fused_lm_head=True) if trl_head
                     else dict(accel_labels=p.labels, accel_entropy=compute_entropy, **(kept or {})))
        if compute_aux_loss:
            extra["output_router_logits"] = True
        with trainer.accelerator.autocast(), packed_forward_context():
            out = model(input_ids=p.input_ids, position_ids=p.position_ids, **extra)
        outs.append((p, out.log_probs, out.entropy, out.log_kept_mass if kept else None))
        if compute_aux_loss:
            routers.append((out.router_logits, token_weights(p.input_ids.size(1), p.segments, p.input_ids.device)))
    rows = input_ids.size(0)
    logps = unpack([(p, lp) for p, lp, _, _ in outs], rows, logits_to_keep)
    entropies = unpack([(p, e) for p, _, e, _ in outs], rows, logits_to_keep) if compute_entropy else None
    log_kept = unpack([(p, z) for p, _, _, z in outs], rows, logits_to_keep) if kept else None
    aux = load_balancing_loss(causal_lm_of(model), routers) if compute_aux_loss else None
    return logps, entropies, aux, log_kept
