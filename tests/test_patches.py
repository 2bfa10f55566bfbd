"""Patches are the trainer's, not the process's: after a trainer with every single-process saver on has trained, a
second trainer with none gives the logits, loss and gradients a fresh process gives (tests/test_sequence_parallel.py
checks the same of SP's attention registration), and transformers' registries are as they were.

    pytest tests/test_patches.py -q   (any OMP_NUM_THREADS: the fresh process gets the same)
"""

import subprocess
import sys

import torch
from peft import LoraConfig
from support.launch import ROOT, child_env
from support.rewards import length_reward

from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.savers import FORCE_OFFLOAD_COPIES_ENV
from grpo_accel.trainer.trainer import GRPOAccelTrainer


def registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {"attention": dict(AttentionInterface._global_mapping),
            "attention_local": dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
            "mask": dict(type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping)}


def trainer_with(out, **savers):
    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=12, report_to="none", max_steps=1, save_steps=100, seed=0,
                           disable_tqdm=True, **savers)
    return GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                            train_dataset=arithmetic_dataset("train", 8), peft_config=LoraConfig(r=4))


def stock_numbers(out) -> dict:
    """A trainer with no saver: logits, TRL's per-token log-probs, a loss over them and its LoRA gradients."""
    torch.manual_seed(0)
    trainer = trainer_with(out, logprob_impl="trl", padding_free=False, offload_activations="false")
    ids = torch.randint(0, trainer.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded prompt, as TRL batches them
    trainer.model.train()
    logits = trainer.model(input_ids=ids, attention_mask=mask).logits.detach()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 10)
    loss = -logps.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"logits": logits, "logps": logps.detach(), "loss": loss.detach(), "grads": grads}


def test_second_trainer_runs_stock_code(tmp_path, monkeypatch):
    import gc

    gc.collect()  # earlier tests' trainers that never trained: dropped, so their patches are undone
    threads = torch.get_num_threads()  # read before the first trainer: one that left it changed must fail below
    before = registries()
    from grpo_accel.parallel.packing import ATTN_NAME

    assert ATTN_NAME not in before["attention"], "an earlier test left packing's attention registered"
    monkeypatch.setenv(FORCE_OFFLOAD_COPIES_ENV, "1")  # the real stash / copy / re-run path on CPU
    first = trainer_with(tmp_path / "first", logprob_impl="chunked", padding_free=True, offload_activations="true",
                         offload_recompute_tokens=8)  # re-runs in sequence tiles
    during = registries()
    causal_lm = first.model.get_base_model()
    trl_forward = causal_lm.forward.__wrapped__  # TRL's own fused-head wrap (its per-instance patch) under ours
    assert causal_lm.config._attn_implementation != "sdpa"  # savers are on
    assert during != before
    first.train()
    assert first.state.global_step == 1
    assert registries() == before
    assert causal_lm.forward is trl_forward and causal_lm.config._attn_implementation == "sdpa"
    monkeypatch.delenv(FORCE_OFFLOAD_COPIES_ENV)

    second = stock_numbers(tmp_path / "second")
    code = f"import torch, test_patches; torch.save(test_patches.stock_numbers({str(tmp_path / 'fresh')!r}), " \
           f"{str(tmp_path / 'fresh.pt')!r})"
    # The fresh process runs with this one's thread count: CPU kernels split reductions by thread, so 1 thread
    # against 2 differs in the last bits (an AVX-512 Xeon, issue 46) and the test would compare thread counts.
    env = child_env(OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = torch.load(tmp_path / "fresh.pt")
    for key in ("logits", "logps", "loss"):
        torch.testing.assert_close(second[key], fresh[key], rtol=1e-6, atol=1e-6, msg=key)
    assert second["grads"].keys() == fresh["grads"].keys() and second["grads"]
    for name, grad in fresh["grads"].items():
        torch.testing.assert_close(second["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)
