"""Each prompt once per group (grpo_accel/parallel/shared_prompt.py) gives the unshared packed path's numbers.

Fresh random batches (fp32, tiny-llama): groups of G rows share a prompt (left-padded, unequal across groups),
completions are ragged (one of 1 token, one cut at the length cap). Through the trainer's log-prob hook, with
share_prompt true and false: per-token log-probs, entropies and every trainable gradient (LoRA and full fine-tuning)
equal <= 1e-5 relative, for G in {2, 8}, and with offload (its real copy path) and 16-token sequence tiles on a
prompt longer than a tile. TRL's own loss on a generated batch, the same. Under 2-process ZeRO-2 / ZeRO-3:
tests/test_distributed.py::test_zero_packed_matches_padded (its packed runs share). The layout can
fail: a completion that does not see its prompt changes its log-probs.

    OMP_NUM_THREADS=1 pytest tests/test_shared_prompt.py -q
"""


import pytest
import torch
from support import trainers
from support.compare import assert_rel_close

from grpo_accel.core.errors import ConfigError
from grpo_accel.parallel.packing import unpack
from grpo_accel.parallel.shared_prompt import Unit, pack_units, prompt_units, split_units_to_count
from grpo_accel.tiling.attention import SEGMENTS_KWARG, Segment
from grpo_accel.trainer.config import GRPOAccelConfig

K = 12  # completion columns (max_completion_length)


def make_trainer(tmp_path, share="true", beta=0.0, **kw):
    """support.trainers.make_trainer with 12 completion tokens, share_prompt set, beta 0 (the config's default)."""
    return trainers.make_trainer(tmp_path, completion_len=K, beta=beta, share_prompt=share, **kw)


def random_batch(G: int, groups: int, prompt_lens, seed: int, vocab: int = 40000):
    """TRL's layout ([B, P_max + K], prompts left-padded, completions right-padded), rows of a group adjacent except
    that the second group's rows are interleaved with the third's (a shuffled generation batch)."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    rows = []
    for p in prompt_lens[:groups]:
        prompt = torch.randint(100, vocab, (p,), generator=g)
        lens = torch.randint(1, K + 1, (G,), generator=g).tolist()
        lens[0], lens[-1] = 1, K  # a one-token completion, one cut at the cap
        for n in lens:
            ids = torch.zeros(P + K, dtype=torch.long)
            mask = torch.zeros(P + K, dtype=torch.long)
            ids[P - p:P], mask[P - p:P] = prompt, 1
            ids[P:P + n], mask[P:P + n] = torch.randint(100, vocab, (n,), generator=g), 1
            rows.append((ids, mask))
    if groups >= 3:  # interleave groups 2 and 3
        a, b = rows[G:2 * G], rows[2 * G:3 * G]
        rows[G:3 * G] = [r for pair in zip(a, b, strict=True) for r in pair]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def hook_run(trainer, ids, mask, share):
    """Log-probs and entropies with grad through the trainer's hook, a loss mixing both, its gradients."""
    trainer.share_prompt = share
    trainer.model.zero_grad(set_to_none=True)
    lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, K, compute_entropy=True)
    weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
    valid = mask[:, -K:].bool()
    ((lp * weights)[valid].sum() + 0.1 * ent[valid].sum()).backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def assert_same(shared, unshared, valid):
    (lp, ent, grads), (lp0, ent0, grads0) = shared, unshared
    torch.testing.assert_close(lp[valid], lp0[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[valid], ent0[valid], rtol=1e-5, atol=1e-6)
    assert (lp[~valid] == 0).all()
    assert grads.keys() == grads0.keys() and grads
    assert_rel_close(grads0, grads, 1e-5, floor=1e-30)


def spy_forwards(trainer, monkeypatch):
    """The packed rows' lengths the model receives."""
    calls = []
    real = type(trainer.model).__call__

    def spy(self, *a, **kw):
        if SEGMENTS_KWARG in kw:
            calls.append(kw["input_ids"].size(1))
        return real(self, *a, **kw)

    monkeypatch.setattr(type(trainer.model), "__call__", spy)
    return calls


@pytest.mark.parametrize("G,peft,impl", [(2, True, "chunked"), (8, True, "chunked"), (8, False, "chunked"),
                                         (4, True, "trl")], ids=["G2-lora", "G8-lora", "G8-full", "G4-trls-head"])
def test_shared_equals_unshared(tmp_path, monkeypatch, G, peft, impl):
    """impl="trl": TRL's own fused head on the shared row (the same label shift)."""
    trainer = make_trainer(tmp_path, peft=peft, logprob_impl=impl)
    assert trainer.logprob_impl == impl
    assert trainer.share_prompt == "true"
    ids, mask = random_batch(G, 3, [9, 23, 5], seed=G)
    unshared = hook_run(trainer, ids, mask, "false")
    calls = spy_forwards(trainer, monkeypatch)
    shared = hook_run(trainer, ids, mask, "true")
    lens = mask[:, -K:].sum(1).tolist()
    # every group shared: P - 1 + sum(C + 1) tokens each, in the one forward (the default budget holds them all)
    expected = sum(p - 1 + sum(c + 1 for c in lens[i * G:(i + 1) * G]) for i, p in enumerate([9, 23, 5]))
    assert calls == [expected], (calls, expected)
    assert_same(shared, unshared, mask[:, -K:].bool())


def test_offload_and_tiles_with_a_prompt_longer_than_a_tile(tmp_path, monkeypatch):
    """Offload's real copy path, 16-token sequence tiles in the backward re-run, 40-token prompts, several
    forwards (a 120-token budget: one group each)."""
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    trainer = make_trainer(tmp_path, offload_activations="true", offload_recompute_tokens=16,
                           logprob_token_budget=120, gradient_checkpointing=True)
    assert trainer.offload_enabled
    trainer.model.train()
    ids, mask = random_batch(4, 3, [40, 33, 47], seed=3)
    unshared = hook_run(trainer, ids, mask, "false")
    calls = spy_forwards(trainer, monkeypatch)
    shared = hook_run(trainer, ids, mask, "true")
    assert len(calls) == 3 and all(n > 16 for n in calls), calls
    assert_same(shared, unshared, mask[:, -K:].bool())


def test_trls_loss_on_a_generated_batch(tmp_path):
    """TRL's compute_loss (its loss, KL to the reference included) on a batch TRL generated: 2 prompts x 4."""
    trainer = make_trainer(tmp_path, beta=0.04)
    torch.manual_seed(1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    results = {}
    for share in ("false", "true"):
        trainer.share_prompt = share
        trainer.packed_passes.ran = trainer.packed_passes.unshared = 0
        torch.manual_seed(1)
        inputs = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results[share] = (inputs["ref_per_token_logps"], loss.detach(),
                          {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    (ref, loss, grads), (ref0, loss0, grads0) = results["true"], results["false"]
    valid = inputs["completion_mask"].bool()
    torch.testing.assert_close(ref[valid], ref0[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-7)
    assert any(g.norm() > 0 for g in grads.values())
    assert grads.keys() <= grads0.keys()
    assert_rel_close({n: grads0[n] for n in grads}, grads, 1e-5, floor=1e-30)
    ran, unshared = trainer.packed_passes.ran, trainer.packed_passes.unshared
    assert ran < 0.8 * unshared  # the shared runs did share (2 prompts x 4 rows)


def test_a_completion_that_misses_its_prompt_is_caught(tmp_path):
    """The comparison above can fail: drop the prefix from the segments (each completion sees only the prompt's last
    token and itself) and the log-probs move."""
    trainer = make_trainer(tmp_path)
    ids, mask = random_batch(4, 1, [20], seed=4)
    units, _ = prompt_units(ids, mask, K, "true")
    p = pack_units(ids, mask, K, units)
    model = trainer.model
    blind = tuple(Segment(s.start, s.end) for s in p.segments)
    with torch.no_grad():
        outs = [model(input_ids=p.input_ids, position_ids=p.position_ids, accel_labels=p.labels,
                      **{SEGMENTS_KWARG: segs}).log_probs for segs in (p.segments, blind)]
    valid = mask[:, -K:].bool()
    good, bad = (unpack([(p, o)], ids.size(0), K)[valid] for o in outs)
    assert (good - bad).abs().max() > 1e-2


def test_auto_shares_long_prompts_only():
    """auto: a group shares when that removes >= 25% of its tokens; a short prompt beside long completions stays
    on today's path; one row or a one-token prompt never shares."""
    long_ids, long_mask = random_batch(4, 2, [30, 30], seed=6)
    units, _ = prompt_units(long_ids, long_mask, K, "auto")
    assert [len(u.rows) for u in units] == [4, 4] and all(u.share for u in units)
    short_ids, short_mask = random_batch(4, 2, [2, 2], seed=6)
    units, _ = prompt_units(short_ids, short_mask, K, "auto")
    assert len(units) == 8 and not any(u.share for u in units)
    assert not any(u.share for u in prompt_units(short_ids, short_mask, K, "false")[0])
    one, one_mask = random_batch(4, 1, [1], seed=6)
    assert not any(u.share for u in prompt_units(one, one_mask, K, "true")[0])


def test_split_units_gives_every_rank_the_same_forwards():
    forwards = [[Unit([0, 1, 2, 3], True)], [Unit([4], False), Unit([5], False)]]
    split = split_units_to_count(forwards, 4)
    assert len(split) == 4 and sorted(r for f in split for u in f for r in u.rows) == list(range(6))
    assert all(u.share for f in split for u in f if 0 in u.rows or 3 in u.rows)
    with pytest.raises(ValueError):
        split_units_to_count([[Unit([0], False)]], 2)


def test_share_prompt_settings_are_checked(tmp_path):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none")
    with pytest.raises(ConfigError, match="share_prompt maybe"):
        GRPOAccelConfig(share_prompt="maybe", **base)
    with pytest.raises(ConfigError, match="padding_free is off"):
        GRPOAccelConfig(share_prompt="true", padding_free=False, **base)
    with pytest.raises(ConfigError, match="sequence_parallel_size 2"):
        GRPOAccelConfig(share_prompt="true", sequence_parallel_size=2, **base)
    assert GRPOAccelConfig(share_prompt=True, **base).share_prompt == "true"


@pytest.mark.parametrize("share", ["true", "auto"])
def test_a_model_without_our_attention_cannot_share(tmp_path, share):
    """eager attention has no packed path (flash_attention_2 reads sequences from position ids, which a shared
    prompt does not restart): "true" stops with one line, "auto" steps aside."""
    if share == "true":
        with pytest.raises(ConfigError, match="share_prompt true cannot run: padding_free is off"):
            make_trainer(tmp_path, share=share, attn="eager")
    else:
        assert make_trainer(tmp_path, share=share, attn="eager").share_prompt == "false"


@pytest.mark.parametrize("mode,shares", [("true", True), ("auto", True), ("false", False)])
def test_planner_counts_the_layouts_tokens(mode, shares):
    """The planner's checkpointed activations scale with the tokens the trainer's layout really packs (2 prompts of
    30 tokens x 4 full-length completions), and "auto" agrees with the trainer's per-batch rule."""
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.memory import plan_memory

    ids, mask = random_batch(4, 2, [30, 30], seed=7)
    mask[:, -K:] = 1
    units, _ = prompt_units(ids, mask, K, mode)
    assert any(u.share for u in units) == shares
    packed = pack_units(ids, mask, K, units).input_ids.size(1)
    plan = dict(num_generations=4, per_device_train_batch_size=8, max_prompt_length=30, max_completion_length=K,
                model_dtype="fp32", lora_r=4, device="cpu")
    shape = model_shape("tiny-llama")
    ours = plan_memory(shape, share_prompt=mode, **plan).device["activations_checkpointed"]
    unshared = plan_memory(shape, share_prompt="false", **plan).device["activations_checkpointed"]
    assert ours / unshared == pytest.approx(packed / (8 * (30 + K)))


@pytest.mark.parametrize("C,G", [(40, 8), (256, 8), (110_000, 8), (1024, 16), (12, 4), (5, 2), (1, 2)])
def test_the_start_up_lines_shortest_shared_prompt_is_the_rules(C, G):
    """The closed form the start-up line quotes equals the first prompt length the per-batch rule shares."""
    from grpo_accel.core.settings import share_prompt_pays
    from grpo_accel.planning.memory import shortest_shared_prompt

    first = next(p for p in range(2, 10 * C + 10) if share_prompt_pays(p, [C] * G, "auto"))
    assert shortest_shared_prompt(C, G) == first
