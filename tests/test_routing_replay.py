"""Routing replay on the two MoE twins (grpo_accel/head/routing_replay.py): exact where it must be.

- Replaying the routing the model's own forward picks is bit-identical to no replay (fp32; logits, router loss and
  every gradient, with gradient checkpointing's re-run).
- A recorded routing that differs changes exactly the tokens it names: at the last MoE layer only that token's
  logits move; at the first, that token's and the later ones of its row, never an earlier token or another row.
- The gate weights are the current router's by the model's own rule, and the router keeps its gradient: equal to
  transformers' own forward with its top-k forced to the record.
- The load-balancing loss is TRL's: transformers' own formula over the current router's logits, which replay leaves
  as the stock router computes them from the same hidden states.
- Undone with its patches: a model after `undo()` holds no instance attribute of ours.

    OMP_NUM_THREADS=1 pytest tests/test_routing_replay.py -q -p no:xdist
"""

import pytest
import torch
from support.compare import assert_equal

from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.head.routing_replay import ROUTING_KWARG, ForwardRouting, RoutingReplay, moe_shape

TWINS = ["tiny-gpt-oss", "tiny-qwen3-moe"]


def twin(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = build_tiny_model(name, load_tokenizer(name)).to(dtype)
    ids = torch.randint(5, model.config.vocab_size, (2, 12))
    return model, dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def forward_and_grads(model, inputs, routing=None):
    model.zero_grad(set_to_none=True)
    extra = {ROUTING_KWARG: routing} if routing is not None else {}
    out = model(**inputs, output_router_logits=True, **extra)
    loss = out.logits.float().logsumexp(-1).mean() + out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.aux_loss.detach(), grads


@pytest.mark.parametrize("name", TWINS)
def test_replaying_the_forwards_own_routing_is_bit_identical(name):
    model, inputs = twin(name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    stock = forward_and_grads(model, inputs)
    replay = RoutingReplay(model)
    patches = replay.install()
    own = replay.own_routing(model, **inputs)
    assert own.shape == (2, 12, *moe_shape(model))
    replayed = forward_and_grads(model, inputs, ForwardRouting(own))
    patches.undo()
    assert_equal(stock[0], replayed[0])
    assert_equal(stock[1], replayed[1])
    assert stock[2].keys() == replayed[2].keys() and any("router" in n or "gate" in n for n in stock[2])
    assert_equal(stock[2], replayed[2])
    assert replay.pop_counts() == (2 * 12 * moe_shape(model)[0] * 2, 0, 0)  # two forwards compared: the re-run too


def other_experts(model, own_row):
    """top-k experts none of which is in `own_row`."""
    n_experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    free = [e for e in range(n_experts) if e not in own_row.tolist()]
    return torch.tensor(free[:own_row.numel()])


@pytest.mark.parametrize("layer", ["last", "first"])
@pytest.mark.parametrize("name", TWINS)
def test_a_differing_routing_changes_exactly_the_tokens_it_names(name, layer):
    model, inputs = twin(name)
    replay = RoutingReplay(model)
    patches = replay.install()
    own = replay.own_routing(model, **inputs)
    row, tok, moe = 1, 6, (own.shape[2] - 1 if layer == "last" else 0)
    moved = own.clone()
    moved[row, tok, moe] = other_experts(model, own[row, tok, moe])
    with torch.no_grad():
        ref = model(**inputs, **{ROUTING_KWARG: ForwardRouting(own)}).logits
        got = model(**inputs, **{ROUTING_KWARG: ForwardRouting(moved)}).logits
        measured = model(**inputs, **{ROUTING_KWARG: ForwardRouting(moved, replay=False)}).logits
    patches.undo()
    changed = (ref != got).any(-1)
    assert changed[row, tok]
    expected = torch.zeros_like(changed)
    expected[row, tok] = True
    if layer == "first":  # later tokens of the row read it through attention; earlier ones and row 0 cannot
        assert not changed[0].any() and not changed[row, :tok].any()
    else:
        assert_equal(expected, changed)
    assert_equal(ref, measured)  # replay off: only measured
    assert replay.pop_counts()[1:] == (2, 1)  # the moved record differs once in the two forwards given it


@pytest.mark.parametrize("name", TWINS)
def test_replay_is_transformers_router_with_its_topk_forced(name, monkeypatch):
    """The gate weights are the current router's, by the model's own rule: the reference is transformers' stock
    forward whose `torch.topk` returns the recorded experts (and the router's values at them), so everything after
    the top-k is transformers' code. Logits and every gradient bit-equal, the routers' gradients nonzero.
    (A float64 finite-difference check cannot judge this: Qwen3-MoE's router softmax runs in float32.)"""
    model, inputs = twin(name)
    replay = RoutingReplay(model)
    patches = replay.install()
    own = replay.own_routing(model, **inputs)
    moved = own.clone()
    moved[0, 3, 0] = other_experts(model, own[0, 3, 0])
    moved[1, :, -1] = own[1, :, -1].roll(1, 0)
    got = forward_and_grads(model, inputs, ForwardRouting(moved))
    patches.undo()
    calls, topk = [], torch.topk

    def forced_topk(values, k, dim=-1, **kw):
        if len(calls) == moved.shape[2]:  # the routers are done: the router loss's own top-k (unforced, as ours)
            return topk(values, k, dim=dim, **kw)
        idx = moved[:, :, len(calls)].reshape(-1, k)
        calls.append(1)
        return values.gather(-1, idx), idx

    monkeypatch.setattr(torch, "topk", forced_topk)
    ref = forward_and_grads(model, inputs)
    monkeypatch.setattr(torch, "topk", topk)
    assert_equal(ref[0], got[0])
    assert_equal(ref[2], got[2])
    routers = [n for n in got[2] if n.endswith(("router.weight", "gate.weight"))]
    assert len(routers) == moe_shape(model)[0] and all(got[2][n].abs().sum() > 0 for n in routers)


@pytest.mark.parametrize("name", TWINS)
def test_the_load_balancing_loss_is_transformers_own_over_the_current_router(name):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model, inputs = twin(name)
    replay = RoutingReplay(model)
    patches = replay.install()
    own = replay.own_routing(model, **inputs)
    moved = own.clone()
    moved[:, :, 0] = own[:, :, 0].flip(1)  # every token of layer 0 takes another token's experts
    router_inputs = []
    hooks = [r.register_forward_pre_hook(lambda m, a: router_inputs.append(a[0])) for _, r in replay.layers]
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True, **{ROUTING_KWARG: ForwardRouting(moved)})
    for h in hooks:
        h.remove()
    # the stock router's forward (the class's, not our instance wrapper) on the hidden states it saw
    stock_logits = tuple(type(r).forward(r, x)[0] for (_, r), x in zip(replay.layers, router_inputs))
    cfg = model.config
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    ref = load_balancing_loss_func(stock_logits, n_experts, cfg.num_experts_per_tok, inputs["attention_mask"])
    patches.undo()
    assert replay.pop_counts()[1] > 0
    assert_equal(ref, out.aux_loss)


@pytest.mark.parametrize("name", TWINS)
def test_undo_leaves_stock_modules(name):
    model, _ = twin(name)
    replay = RoutingReplay(model)
    patches = replay.install()
    assert all("forward" in r.__dict__ and "forward" in layer.self_attn.__dict__ for layer, r in replay.layers)
    patches.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())


def batch(vocab, rows=4, prompt=5, completion=6):
    """TRL's layout: prompts left-padded, completions right-padded (row r: r pads on each side)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (rows, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, :r % 2] = 0
        mask[r, prompt + completion - r:] = 0
    return ids, mask


def packed_own_routing(trainer, ids, mask, logits_to_keep):
    """The routing the trainer's own (packed, one-forward) pass picks, back in the padded layout."""
    with trainer.routing_replay.recording() as calls:
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, logits_to_keep)
    L = len(calls)
    own = torch.full((*ids.shape, L, calls[0][0].shape[-1]), -1, dtype=torch.int16)
    for n in range(L):
        (rows,) = calls[n]  # one packed forward: the batch's real tokens, row-major
        own[:, :, n][mask.bool()] = rows.to(torch.int16)
    return own


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", TWINS)
def test_the_log_prob_passes_replay_each_rows_record(name, padding_free, tmp_path):
    """Through the trainer's one TRL hook: a record of the pass's own routing (found by each row's tokens, wherever
    TRL's shuffle put the row) gives bit-identical log-probs; moving one token's experts in row 2's record changes
    row 2's log-probs and no other row's; a row without a record routes by its own top-k."""
    from support.trainers import make_trainer

    trainer = make_trainer(tmp_path, name, peft=False, padding_free=padding_free, logprob_token_budget=4096,
                           share_prompt="false", offload_activations="false", use_transformers_continuous_batching=True)
    assert trainer.routing_replay is not None and trainer.routing_replay.replaying
    lm = trainer.model
    ids, mask = batch(lm.config.vocab_size)
    keep = 6
    hook = lambda: trainer._get_per_token_logps_and_entropies(lm, ids, mask, keep)[0]  # noqa: E731
    with torch.no_grad():
        stock = hook()
        own = (packed_own_routing(trainer, ids, mask, keep) if padding_free
               else trainer.routing_replay.own_routing(lm, input_ids=ids, attention_mask=mask).to(torch.int16))
        records = {tuple(ids[r][mask[r].bool()].tolist()): own[r][mask[r].bool()] for r in range(len(ids))}
        trainer.routing_records.replace(records)
        trainer.routing_replay.pop_counts()
        replayed = hook()
        assert trainer.routing_replay.pop_counts()[1:] == (0, 0)
        moved = dict(records)
        key = tuple(ids[2][mask[2].bool()].tolist())
        moved[key] = records[key].clone()
        moved[key][3, 0] = other_experts(lm, records[key][3, 0].long())
        del moved[tuple(ids[0][mask[0].bool()].tolist())]  # row 0: no record
        trainer.routing_records.replace(moved)
        got = hook()
    assert_equal(stock, replayed)
    changed = (got != replayed).any(-1)
    assert changed.tolist() == [False, False, True, False]
    assert trainer.routing_records.pop_rows() == (4 + 3, 1)


def test_the_k3_estimate_is_the_kl_of_the_behaviour_from_the_trainer():
    """Tokens drawn in exact proportion to the behaviour distribution p (p = 1/2, 1/4, 1/8, 1/8: counts 4, 2, 1, 1):
    the mean of exp(d) - 1 - d with d = log q - log p is KL(p || q) exactly (sum of q is 1), against torch's own
    kl_divergence; NaN behaviour log-probs (on-policy tokens) and masked tokens are left out."""
    from grpo_accel.trainer.mismatch import MismatchMeter

    p = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    tokens = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])
    behaviour = torch.cat([p[tokens].log(), torch.tensor([float("nan"), 0.0])])[None]
    old = torch.cat([q[tokens].log(), torch.tensor([-1.0, -5.0])])[None]
    mask = torch.tensor([[1] * 9 + [0]])
    meter = MismatchMeter()
    meter.observe({"old_per_token_logps": old.float(), "sampling_per_token_logps": behaviour.float(),
                   "completion_mask": mask})
    got = meter.pop_metrics()
    kl = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=p),
                                           torch.distributions.Categorical(probs=q))
    assert got["sampling/k3_kl"] == pytest.approx(float(kl), rel=1e-6)  # float32 log-probs in, as TRL's
    assert got["sampling/logp_gap_mean"] == pytest.approx(float((q[tokens].log() - p[tokens].log()).mean()), rel=1e-6)
    assert meter.pop_metrics() == {}
