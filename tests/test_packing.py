"""Padding-free micro-batches (grpo_accel/parallel/packing.py) give the padded path's numbers.

Batches of very unequal lengths (completions of 1 token to the full length, left-padded prompts of unequal
length): log-probs, entropies, TRL's loss and every gradient of the packed path equal the padded path's
(fp32, <= 1e-5 relative), per loss_type, with several forwards under a small token budget, with offload's
real copy path and checkpoint re-run, with LoRA and full fine-tuning; unsupported models fall back with one
line; a 2-step launch/train.py run logs the same loss and gradient norm either way.
"""

import csv

import pytest
import torch
from support.compare import assert_rel_close, rel_norm
from support.launch import TINY_ARGS, run_train
from support.trainers import ROWS, K, count_packed_forwards, make_trainer, run_hook, unequal_batch

from grpo_accel.parallel.packing import pack_rows, plan_micro_batches, split_to_count, unpack
from grpo_accel.tiling.attention import segments_of


def assert_same(packed, padded, valid):
    (lp, ent, loss, grads), (lp0, ent0, loss0, grads0) = packed, padded
    torch.testing.assert_close(lp[valid], lp0[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[valid], ent0[valid], rtol=1e-5, atol=1e-6)
    assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all()
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-7)
    assert grads.keys() == grads0.keys() and grads
    assert_rel_close(grads0, grads, 1e-5, floor=1e-30)


@pytest.mark.parametrize("model_name,peft,loss_type,impl", [
    ("tiny-llama", True, "dapo", "chunked"), ("tiny-llama", True, "grpo", "chunked"),
    ("tiny-llama", True, "dr_grpo", "chunked"), ("tiny-llama", False, "bnpo", "chunked"),
    ("tiny-qwen2", True, "dapo", "chunked"), ("tiny-llama", True, "dapo", "trl"),
])
def test_packed_equals_padded(tmp_path, monkeypatch, model_name, peft, loss_type, impl):
    """impl="trl": TRL's own fused head on the packed rows, against TRL's own hook on the padded ones."""
    trainer = make_trainer(tmp_path, model_name, peft=peft, loss_type=loss_type, logprob_impl=impl)
    assert trainer.logprob_impl == impl
    assert trainer.padding_free
    inputs = unequal_batch(trainer)
    padded = run_hook(trainer, inputs, padding_free=False)
    calls = count_packed_forwards(trainer, monkeypatch)
    packed = run_hook(trainer, inputs, padding_free=True)
    real_tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    assert calls and all(s[0] == 1 for s in calls) and calls[0][1] == real_tokens, calls
    assert_same(packed, padded, inputs["completion_mask"].bool())


def test_token_budget_splits_forwards_and_keeps_gradients(tmp_path, monkeypatch):
    """A budget of about two rows: several packed forwards per pass, each within the budget."""
    trainer = make_trainer(tmp_path)
    inputs = unequal_batch(trainer)
    lengths = (inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).tolist()
    budget = trainer.args.logprob_token_budget = 2 * max(lengths)
    padded = run_hook(trainer, inputs, padding_free=False)
    calls = count_packed_forwards(trainer, monkeypatch)
    packed = run_hook(trainer, inputs, padding_free=True)
    per_pass = len(calls) // 2  # the no-grad hook call, then the loss's
    assert per_pass >= 3 and all(s[1] <= budget for s in calls), calls
    assert sum(s[1] for s in calls[:per_pass]) == sum(lengths)
    assert_same(packed, padded, inputs["completion_mask"].bool())


def test_tiles_mini_batches_and_our_head_equal_stock_trl(tmp_path, monkeypatch):
    """tiling x mini-batch and tiling x fused head (docs/pairs.md): packed forwards within a token budget of about two
    rows, our chunked head, offload copies with each layer re-run in tiles of 8 tokens, against the same trainer after
    close(): TRL's own head on padded rows, transformers' checkpointing, no offload. Same log-probs, loss, grads."""
    from grpo_accel.tiling import layer as tiled

    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    trainer = make_trainer(tmp_path, offload_activations="true", gradient_checkpointing=True,
                           offload_recompute_tokens=8)
    inputs = unequal_batch(trainer)
    lengths = (inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).tolist()
    trainer.args.logprob_token_budget = 2 * max(lengths)
    tiles, real = [], tiled.backward
    monkeypatch.setattr(tiled, "backward", lambda *a: tiles.append(len(a[3])) or real(*a))
    calls = count_packed_forwards(trainer, monkeypatch)
    ours = run_hook(trainer, inputs, padding_free=True)
    assert len(calls) // 2 >= 3 and tiles and max(tiles) >= 2, (calls, tiles)  # budgeted forwards, re-run in tiles
    trainer.close()
    tiles.clear()
    stock = run_hook(trainer, inputs, padding_free=False)
    assert not tiles and trainer.logprob_impl == "chunked"  # closed: TRL's paths ran (the attribute keeps the name)
    assert_same(ours, stock, inputs["completion_mask"].bool())


def test_offload_copies_and_rerun(tmp_path, monkeypatch):
    """Offload's real copy path, checkpointed layers re-run in backward with the packed kwargs."""
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    trainer = make_trainer(tmp_path, offload_activations="true", gradient_checkpointing=True)
    assert trainer.offload_enabled and trainer.padding_free
    inputs = unequal_batch(trainer)
    padded = run_hook(trainer, inputs, padding_free=False)
    packed = run_hook(trainer, inputs, padding_free=True)
    assert_same(packed, padded, inputs["completion_mask"].bool())


def test_gradient_checkpointing_rerun(tmp_path):
    """transformers' own checkpointing (as Trainer.train() switches it on): layers re-run in backward with the
    packed kwargs, after the packed forward's context has closed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    trainer = make_trainer(tmp_path, gradient_checkpointing=True)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all(m.gradient_checkpointing for m in layers)
    inputs = unequal_batch(trainer)
    padded = run_hook(trainer, inputs, padding_free=False)
    packed = run_hook(trainer, inputs, padding_free=True)
    assert_same(packed, padded, inputs["completion_mask"].bool())


def test_cross_sequence_attention_would_be_caught(tmp_path):
    """The parity above can fail: one causal mask over the packed row (what transformers does when a cache is
    made, use_cache=True) changes every later sequence's log-probs."""
    trainer = make_trainer(tmp_path)
    inputs = unequal_batch(trainer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    p = pack_rows(ids, mask, K, list(range(ROWS)))
    model = trainer.model
    with torch.no_grad():
        good = model(input_ids=p.input_ids, position_ids=p.position_ids, accel_labels=p.labels,
                     accel_segments=p.segments).log_probs
        leaky = model(input_ids=p.input_ids, position_ids=p.position_ids, accel_labels=p.labels,
                      accel_segments=segments_of([p.input_ids.size(1)])).log_probs
    valid = inputs["completion_mask"].bool()
    a, b = unpack([(p, good)], ROWS, K)[valid], unpack([(p, leaky)], ROWS, K)[valid]
    assert (a - b).abs().max() > 1e-2


def test_plan_micro_batches_longest_first_under_budget():
    lengths = [5, 40, 12, 33, 1, 20, 8]
    groups = plan_micro_batches(lengths, token_budget=40)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert all(sum(lengths[r] for r in g) <= 40 for g in groups)
    assert groups[0] == [1] and len(groups) == 3  # 40 alone; 33+5+1; 20+12+8
    assert plan_micro_batches([50, 3], token_budget=10) == [[0], [1]]  # too long for the budget: alone


def test_split_to_count_gives_every_rank_the_same_forwards():
    groups = plan_micro_batches([50, 40, 30, 20, 10, 5], token_budget=100)
    assert len(groups) == 2
    split = split_to_count(groups, 4)
    assert len(split) == 4 and sorted(r for g in split for r in g) == list(range(6)) and all(split)
    assert split_to_count(groups, 2) == groups
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], 3)


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="llama"), None), (dict(model_type="qwen2"), None),
    (dict(model_type="mistral", sliding_window=4096), "sliding attention window (4096 tokens)"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1), "sliding_attention"),
    (dict(model_type="llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "dynamic"),
])
def test_unsupported_reasons(config, reason):
    from types import SimpleNamespace

    from transformers import AutoConfig

    from grpo_accel.parallel.packing import packing_unsupported_reason

    cfg = AutoConfig.for_model(**config, num_hidden_layers=2)
    got = packing_unsupported_reason(cfg)  # before any weights load: the config alone
    assert (got is None) if reason is None else (reason in (got or "")), got
    cfg._attn_implementation = "sdpa"
    assert packing_unsupported_reason(SimpleNamespace(config=cfg)) == got  # a model (anything with .config)
    cfg._attn_implementation = "eager"
    assert "'eager'" in packing_unsupported_reason(cfg)


@pytest.mark.parametrize("impl", ["chunked", "trl"])
def test_unsupported_falls_back_with_one_line(tmp_path, capsys, impl):
    reason = "attention implementation 'eager'"
    trainer = make_trainer(tmp_path, attn="eager", logprob_impl=impl)
    assert not trainer.padding_free
    lines = [line for line in capsys.readouterr().out.splitlines() if "padding_free" in line]
    assert len(lines) == 1 and "falls back to padded rows" in lines[0] and reason in lines[0], lines


def test_launch_padding_free_true_and_false_log_the_same_loss(tmp_path):
    runs = {}
    for flag in ("true", "false"):
        out = tmp_path / flag
        result = run_train([*TINY_ARGS, "--output_dir", str(out), "--eval_size", "0", "--seed", "3",
                            "--padding_free", flag, "--rewards", "support.rewards:length_reward"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("padding_free: log-prob passes run on packed rows" in result.stdout) == (flag == "true")
        runs[flag] = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["step"] for r in runs["true"]] == [r["step"] for r in runs["false"]] and len(runs["true"]) == 2
    for packed, padded in zip(runs["true"], runs["false"], strict=True):
        for key in ("loss", "grad_norm", "reward"):
            assert float(packed[key]) == pytest.approx(float(padded[key]), rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_packed_bf16_error_is_the_padded_paths(tmp_path, monkeypatch, dtype):
    """bf16 / fp16 autocast (CPU): packed and padded rows round differently, so they are compared the way
    ml-cross-entropy compares a fast path: each one's error against the fp32 result of the same batch (autocast off),
    the packed path's error at most 1.5x the padded path's plus a small floor, for log-probs, loss and every LoRA
    gradient. fp16: accelerate refuses fp16 without a GPU, so the bf16 trainer's autocast is swapped for fp16's."""
    import contextlib

    trainer = make_trainer(tmp_path, bf16=True, use_cpu=True)
    if dtype == "fp16":
        monkeypatch.setattr(trainer.accelerator, "autocast", lambda: torch.autocast("cpu", dtype=torch.float16))
    inputs = unequal_batch(trainer)
    valid = inputs["completion_mask"].bool()
    padded = run_hook(trainer, inputs, padding_free=False)
    packed = run_hook(trainer, inputs, padding_free=True)
    monkeypatch.setattr(trainer.accelerator, "autocast", contextlib.nullcontext)
    exact = run_hook(trainer, inputs, padding_free=False)

    def err(a, b):
        return rel_norm(a, b, floor=1e-30)

    errors = {"logps": (err(packed[0][valid], exact[0][valid]), err(padded[0][valid], exact[0][valid])),
              "loss": (err(packed[2], exact[2]), err(padded[2], exact[2]))}
    errors.update({name: (err(packed[3][name], g), err(padded[3][name], g)) for name, g in exact[3].items()})
    # half is on: the padded path's gradients are ~0.6% off fp32 in bf16 (measured), not fp32's ~1e-7
    assert max(reference for _, reference in errors.values()) > (1e-3 if dtype == "bf16" else 1e-4), \
        f"autocast did not run in {dtype}"
    for name, (ours, reference) in errors.items():
        assert ours <= 1.5 * reference + 1e-3, f"{name}: packed bf16 error {ours:.2e} vs padded {reference:.2e}"
