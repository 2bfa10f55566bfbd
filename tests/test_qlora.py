"""QLoRA (LoRA on a bitsandbytes 4-bit NF4 base) with each saver: the saver on vs an independent reference on the
same 4-bit model (the saver off, or TRL's own head), comparing log-probs, TRL's loss and every adapter gradient.

The 4-bit model is tiny-llama saved to a directory once per module (a model built in code refuses 4-bit) and loaded
with `load_model(dir, quantization="4bit")`, the product's own loader. bitsandbytes >= 0.45 runs NF4 on CPU.
Two things are set on every trainer here, and why:
- TRL 1.16 stores QLoRA adapters in bf16 (QLoRA paper); their grads then round to bf16 (~4e-3 relative), which would
  hide a saver's error under bf16's noise. The exact comparisons keep the adapters fp32, so fp32 <= 1e-5 can hold.
- PEFT starts lora_B at zero, so lora_A's first gradient is zero and compares equal whatever a saver does: the
  adapters are drawn at random (seeded, the same on every trainer), and every gradient is checked non-zero.

    OMP_NUM_THREADS=1 pytest tests/test_qlora.py -q
"""

import pytest
import torch
from support.compare import assert_rel_close, rel_norm
from support.trainers import K, count_packed_forwards, qlora_trainer, run_hook, saved_tiny_model, unequal_batch
from trl import GRPOTrainer

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny-llama-saved"))


@pytest.fixture(scope="module")
def batch(model_dir, tmp_path_factory):
    """One generated batch of unequal lengths (support.trainers.unequal_batch), and the savers-off runs on it (run_hook:
    log-probs, entropies, loss, grads) padded and packed, with the packed forwards' shapes. Every trainer here has the
    same base and adapter weights, so the batch and these references hold for each of them."""
    trainer = qlora_trainer(tmp_path_factory.mktemp("batch"), model_dir)
    inputs = unequal_batch(trainer)
    with pytest.MonkeyPatch.context() as mp:
        packed_forwards = count_packed_forwards(trainer, mp)
        runs = {padding_free: run_hook(trainer, inputs, padding_free) for padding_free in (False, True)}
    return inputs, runs, packed_forwards


def assert_same(got, ref, valid, rtol=1e-5):
    """fp32 on both sides and the same math up to summation order (pieces, tiles, packed rows, chunks): ~1e-7
    relative, measured; 1e-5 leaves room for other CPUs' kernels while a wrong re-run or a leaked token is >= 1e-3."""
    (lp, ent, loss, grads), (lp0, ent0, loss0, grads0) = got, ref
    torch.testing.assert_close(lp[valid], lp0[valid], rtol=rtol, atol=1e-6)
    torch.testing.assert_close(ent[valid], ent0[valid], rtol=rtol, atol=1e-6)
    torch.testing.assert_close(loss, loss0, rtol=rtol, atol=1e-7)
    assert grads.keys() == ref[3].keys() and len(grads) == 2 * 7 * 2  # A, B x 7 linears x 2 layers
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert_rel_close(grads0, grads, rtol, nonzero=True)


def counting(monkeypatch, owner, name):
    """Calls of `owner.name`, counted (it still runs)."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_offload_matches_offload_off(tmp_path, model_dir, batch, monkeypatch, padding_free):
    """Offload's real copy path (forced on CPU) with its re-run in backward: padded rows re-run in row groups of 2,
    a packed row (one forward per 2 rows' worth of tokens) re-run whole; vs offload and checkpointing off."""
    from grpo_accel.offload import rerun, stash

    inputs, ref, _ = batch
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    row = inputs["prompt_ids"].size(1) + K
    trainer = qlora_trainer(tmp_path, model_dir, offload_activations="true", gradient_checkpointing=True,
                           offload_recompute_tokens=2 * row)
    assert trainer.offload_enabled
    copies, groups = counting(monkeypatch, stash.StashEntry, "offload"), counting(monkeypatch, rerun, "_grouped_rerun")
    assert_same(run_hook(trainer, inputs, padding_free), ref[padding_free], inputs["completion_mask"].bool())
    assert copies, "nothing went through the offload stash"
    assert bool(groups) == (not padding_free)  # 2 layers re-run in 4 row groups each


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_tiles_match_offload_off(tmp_path, model_dir, batch, monkeypatch, padding_free):
    """offload_recompute_tokens 16, shorter than all rows but the shortest: rows re-run in sequence tiles (packed:
    one row per forward, as the re-run's budget caps the packing budget); vs offload and checkpointing off."""
    from grpo_accel.tiling import layer as tiled

    inputs, ref, _ = batch
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    trainer = qlora_trainer(tmp_path, model_dir, offload_activations="true", gradient_checkpointing=True,
                           offload_recompute_tokens=16)
    tiles = counting(monkeypatch, tiled, "backward")
    assert_same(run_hook(trainer, inputs, padding_free), ref[padding_free], inputs["completion_mask"].bool())
    assert tiles, "no layer re-ran in tiles"


def test_packed_equals_padded(batch):
    """padding_free on (one packed row of all real tokens per forward) vs off, the same trainer."""
    inputs, runs, packed_forwards = batch
    real_tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    assert packed_forwards == [(1, real_tokens)] * 2, packed_forwards  # the no-grad pass, then the loss's
    assert_same(runs[True], runs[False], inputs["completion_mask"].bool())


@pytest.mark.parametrize("padding_free", [False, True], ids=["rows", "token_budget"])
def test_mini_batches_match_one_forward(tmp_path, model_dir, batch, monkeypatch, padding_free):
    """Several log-prob forwards before one backward (logprob_mini_batch 3 on padded rows; a token budget of about
    two rows on packed ones) vs one forward of the whole batch."""
    inputs, ref, _ = batch
    lengths = inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)
    trainer = qlora_trainer(tmp_path, model_dir, logprob_mini_batch=3, logprob_token_budget=2 * int(lengths.max()))
    forwards = counting(monkeypatch, type(trainer.model), "__call__")
    got = run_hook(trainer, inputs, padding_free)
    assert len(forwards) >= 2 * 3, forwards  # >= 3 forwards in the no-grad pass and >= 3 in the loss's
    assert_same(got, ref[padding_free], inputs["completion_mask"].bool())


def test_fused_head_matches_trls(tmp_path, model_dir, batch, monkeypatch):
    """Our chunked head vs TRL's own hook and head, on padded rows (TRL's path as it ships)."""
    inputs, ours, _ = batch
    trainer = qlora_trainer(tmp_path, model_dir, logprob_impl="trl")
    trl_hook = counting(monkeypatch, GRPOTrainer, "_get_per_token_logps_and_entropies")
    trls = run_hook(trainer, inputs, padding_free=False)
    assert trl_hook, "the reference did not run TRL's hook"
    assert_same(ours[False], trls, inputs["completion_mask"].bool())


def set_compute_dtype(model, dtype):
    """What `bnb_4bit_compute_dtype` sets: the dtype each Linear4bit casts its input to and multiplies in."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.compute_dtype = dtype
    return layers


def dequantized_copy(tmp_path, model_dir, quantized):
    """An ordinary (unquantized) trainer whose linears hold `quantized`'s 4-bit weights dequantized to fp32: the same
    function in fp32, computed without bitsandbytes."""
    import bitsandbytes as bnb

    trainer = qlora_trainer(tmp_path, model_dir, quantization="none")
    for name, m in quantized.model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
            trainer.model.get_submodule(name).weight.data = w.reshape(m.out_features, m.in_features)
    return trainer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_compute_error_is_the_unquantized_paths(tmp_path, model_dir, batch, monkeypatch, dtype):
    """Half-precision compute (CPU autocast in `dtype`, and `dtype` as the 4-bit layers' compute dtype, as
    bnb_4bit_compute_dtype sets it) vs fp32 compute, for the 4-bit model and for an ordinary model holding the same
    weights dequantized (one fp32 function: checked first). The same weights make the two errors comparable: they
    measured 0.8-1.3x of each other per tensor. Bounds: the 4-bit path's error <= 1.5x the ordinary path's for the
    log-probs, the loss and all adapter grads as one vector, <= 2x per adapter tensor (small tensors vary more)."""
    import bitsandbytes as bnb

    batch, _, _ = batch
    valid = batch["completion_mask"].bool()
    quantized = qlora_trainer(tmp_path / "4bit", model_dir)
    plain = dequantized_copy(tmp_path / "none", model_dir, quantized)
    exact = {"4bit": run_hook(quantized, batch, padding_free=True), "none": run_hook(plain, batch, padding_free=True)}
    assert_same(exact["4bit"], exact["none"], valid)
    seen = []  # the dtypes the 4-bit matmuls ran in
    real = bnb.matmul_4bit
    monkeypatch.setattr(bnb, "matmul_4bit", lambda A, *a, **kw: seen.append(A.dtype) or real(A, *a, **kw))
    errors = {}
    for key, trainer in (("4bit", quantized), ("none", plain)):
        set_compute_dtype(trainer.model, dtype)
        monkeypatch.setattr(trainer.accelerator, "autocast", lambda: torch.autocast("cpu", dtype=dtype))
        errors[key] = half_errors(run_hook(trainer, batch, padding_free=True), exact[key], valid)
    assert seen and set(seen) == {dtype}
    assert errors["none"]["adapter grads"] > 1e-3, "no half-precision error: did autocast run?"
    for what, err in errors["4bit"].items():
        ref, ratio = errors["none"][what], 2.0 if what.endswith(".weight") else 1.5
        assert err <= ratio * ref + 1e-7, f"{what}: 4-bit {dtype} error {err:.2e} vs unquantized {ref:.2e}"


def half_errors(half, exact, valid):
    """Relative errors of `half` vs `exact` (run_hook results): log-probs, loss, all grads, each grad."""
    names = sorted(exact[3])
    flat = lambda grads: torch.cat([grads[n].float().flatten() for n in names])
    return {"logps": rel_norm(half[0][valid], exact[0][valid]), "loss": rel_norm(half[2], exact[2]),
            "adapter grads": rel_norm(flat(half[3]), flat(exact[3])),
            **{n: rel_norm(half[3][n], exact[3][n]) for n in names}}
