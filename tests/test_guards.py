"""Non-finite steps are skipped, never applied; N in a row stop training without saving the bad state."""

import torch
from peft import LoraConfig

from grpo_accel.config import GRPOAccelConfig
from grpo_accel.data import arithmetic_dataset
from grpo_accel.models import load_model
from grpo_accel.trainer import GRPOAccelTrainer
from rewards_for_tests import length_reward


def test_nan_steps_are_skipped_then_stop(tmp_path):
    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=6, report_to="none", max_steps=6, save_steps=1, logging_steps=1,
                           max_nonfinite_steps=2, seed=0)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", 24), peft_config=LoraConfig(r=4))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    norm = trainer.model.get_base_model().model.norm
    # Poison only training forwards (grad enabled): generation stays finite, every loss becomes NaN.
    norm.register_forward_hook(lambda m, i, out: out * float("nan") if torch.is_grad_enabled() else out)
    trainer.train()
    guard = trainer.nonfinite_guard
    assert guard.stopped_at == 2 and guard.skipped == 2
    assert trainer.state.global_step == 2
    for name, p in trainer.model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), f"{name} changed by a non-finite step"
            assert p.isfinite().all()
    logged = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["nonfinite/skipped_steps"] for h in logged] == [1.0, 2.0]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
