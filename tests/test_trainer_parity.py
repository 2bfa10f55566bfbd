"""Our trainer's log-probs, entropies, loss and gradients equal TRL 1.16's own, per logprob_impl.

If TRL renames or re-signatures `_get_per_token_logps_and_entropies`, or stops calling it from the
loss, these tests fail: that hook is the one private TRL method we override.
"""

import contextlib
import inspect

import pytest
import torch
from support import trainers
from support.trainers import grads_of, one_batch
from trl import GRPOTrainer

from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.trainer import GRPOAccelTrainer

HOOK_PARAMS = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
               "compute_aux_loss"]


def test_trl_hook_signature_is_the_one_we_override():
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[: len(HOOK_PARAMS)] == HOOK_PARAMS, "TRL moved the hook: re-check GRPOAccelTrainer's override"
    assert "_get_per_token_logps_and_entropies" in inspect.getsource(GRPOTrainer._compute_loss)


def make_trainer(tmp_path, impl, peft=True, **overrides):
    """support.trainers.make_trainer with 4 rows, logprob_impl=impl, in tmp_path / impl."""
    return trainers.make_trainer(tmp_path, peft=peft, rows=4, out=impl, logprob_impl=impl, **overrides)


@pytest.mark.parametrize("impl", ["chunked", "triton"])
@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_logps_loss_and_grads_match_trl(tmp_path, impl, peft, monkeypatch):
    if impl == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            pytest.skip("triton head runs on CUDA tensors; its CPU interpreter parity is in test_logprobs_triton")
    ours = make_trainer(tmp_path, impl, peft)
    assert ours.logprob_impl == impl
    inputs = one_batch(ours)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    k = inputs["completion_ids"].size(1)
    with torch.no_grad():
        lp, ent, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, k, compute_entropy=True)
        ref_lp, ref_ent, _ = GRPOTrainer._get_per_token_logps_and_entropies(ours, ours.model, ids, mask, k,
                                                                            compute_entropy=True)
    valid = inputs["completion_mask"].bool()
    assert lp.shape == ref_lp.shape
    torch.testing.assert_close(lp[valid], ref_lp[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[valid], ref_ent[valid], rtol=1e-5, atol=1e-5)

    calls = []
    original = GRPOAccelTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(GRPOAccelTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    loss, grads = grads_of(ours, inputs)
    assert calls, "TRL's loss no longer goes through the hook we override"
    ours.logprob_impl = "trl"
    ref_loss, ref_grads = grads_of(ours, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_head_hidden_offload_keeps_grads(tmp_path, monkeypatch):
    """With offload on (real copy path forced), the head's saved hidden states go through the stash and the
    loss and every gradient still equal TRL's head."""
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    ours = make_trainer(tmp_path, "chunked", offload_activations="true", gradient_checkpointing=True)
    assert ours.offload_enabled
    inputs = one_batch(ours)
    import grpo_accel.head.logprob_head as head
    import grpo_accel.offload as offload

    packed = []
    real_hooks, real_offload = head.offload_saved_tensors, offload.StashEntry.offload

    @contextlib.contextmanager
    def counting_hooks(**kw):  # count what goes to the stash while the head's saved-tensor hooks are active
        offload.StashEntry.offload = lambda self: packed.append(1) or real_offload(self)
        try:
            with real_hooks(**kw):
                yield
        finally:
            offload.StashEntry.offload = real_offload

    monkeypatch.setattr(head, "offload_saved_tensors", counting_hooks)
    loss, grads = grads_of(ours, inputs)
    assert packed, "the head's saved hidden states did not go through the offload stash"
    ours.logprob_impl = "trl"
    ref_loss, ref_grads = grads_of(ours, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_mini_batch_rows_give_the_same_logps(tmp_path, dtype):
    """Several log-prob forwards (3 rows each) give one forward's log-probs: fp32 to 1e-6; under bf16 / fp16
    autocast (mini-batch x bf16 / fp16 in docs/pairs.md) within a fifth of that dtype's own error against fp32,
    since each row's computation is the same and only batched kernels may round differently."""
    trainer = make_trainer(tmp_path, "chunked", logprob_mini_batch=3)
    inputs = one_batch(trainer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    k = inputs["completion_ids"].size(1)

    def logps(rows):
        trainer.args.logprob_mini_batch = rows
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k)[0]

    a, b = logps(3), logps(None)
    if dtype is None:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        return
    keep = inputs["completion_mask"].bool()
    with torch.no_grad():
        trainer.args.logprob_mini_batch = None
        ref = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k)[0]
    half_err = (b - ref)[keep].abs().max().item()
    assert half_err > 1e-5, "autocast did not run in half precision"
    assert (a - b)[keep].abs().max().item() <= 0.2 * half_err, ((a - b)[keep].abs().max().item(), half_err)


def test_bad_logprob_impl_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="--logprob_impl fast is not one of trl, chunked, triton, auto"):
        GRPOAccelConfig(output_dir=str(tmp_path), logprob_impl="fast")
