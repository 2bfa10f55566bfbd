"""One tiny GRPOAccelTrainer builder for the parity tests (packing, shared prompt, QLoRA, TRL parity, the SP and QLoRA
workers), and the batches and hook runs they share.

`make_trainer`'s defaults are test_packing's (8 rows, 4 generations, 10 completion tokens, LoRA r=4 on q/v/down,
beta 0.04 with LoRA and 0 without: full fine-tuning with a beta loads a reference by hub id, which a tiny model lacks);
the other tests pass what differs (test_trainer_parity: 4 rows; test_shared_prompt: 12 tokens, beta 0;
`qlora_trainer`: a saved model loaded 4-bit, LoRA on every linear, random fp32 adapters).
"""

import torch
from peft import LoraConfig

from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.trainer import GRPOAccelTrainer
from support.rewards import length_reward

ROWS, K = 8, 10  # rows of the batch, max completion tokens
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def make_trainer(tmp_path, model="tiny-llama", *, peft=True, attn=None, quantization="none", rows=ROWS,
                 completion_len=K, beta=None, lora_targets=LORA_TARGETS, out="out", **overrides):
    """A GRPOAccelTrainer on a tiny model (seeded), length_reward, 8 arithmetic prompts; `overrides` go to
    GRPOAccelConfig (logprob_impl defaults to chunked). beta None: 0.04 with LoRA (peft), 0 without."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model, quantization=quantization)
    if attn:
        model.set_attn_implementation(attn)
    overrides.setdefault("logprob_impl", "chunked")
    args = GRPOAccelConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=rows, num_generations=4,
                           max_completion_length=completion_len, report_to="none", seed=0,
                           beta=(0.04 if peft else 0.0) if beta is None else beta,
                           logging_steps=1, max_steps=1, **overrides)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets) if peft else None
    return GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                            train_dataset=arithmetic_dataset("train", 8), peft_config=lora)


def saved_tiny_model(path, name="tiny-llama") -> str:
    """`name` built in code and saved with its tokenizer under `path`: 4-bit loading (and a worker process) needs a
    folder, a model built in code is refused."""
    model, tokenizer = load_model(name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def qlora_trainer(tmp_path, model_dir, quantization="4bit", **overrides):
    """test_qlora's trainer: the saved tiny-llama in `model_dir` loaded 4-bit (or not), LoRA on every linear with
    adapters drawn at random in fp32 (seeded, the same on every trainer; see test_qlora's docstring), in train mode."""
    trainer = make_trainer(tmp_path, model_dir, quantization=quantization, lora_targets="all-linear", **overrides)
    assert getattr(trainer.model.get_base_model(), "is_loaded_in_4bit", False) == (quantization == "4bit")
    g = torch.Generator().manual_seed(7)
    for p in (p for _, p in sorted(trainer.model.named_parameters()) if p.requires_grad):
        p.data = torch.randn(p.shape, generator=g) * 0.1  # fp32, random A and B
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by the loss
    return trainer


def one_batch(trainer):
    """The first 4 prompts, generated (seed 1), in train mode."""
    torch.manual_seed(1)
    batch = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by the loss
    return trainer._generate_and_score_completions(batch)


def grads_of(trainer, inputs):
    """TRL's loss on `inputs` and its gradients."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def unequal_batch(trainer):
    """A real generated batch, re-masked: completion lengths from 1 token to K, prompts left-padded unequally
    (the one with the longest prompt keeps it whole)."""
    torch.manual_seed(1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(ROWS)])
    completion_lengths = torch.tensor([1, K, 2, 7, K, 1, 5, 3])
    cols = torch.arange(inputs["completion_ids"].size(1))
    assert inputs["completion_ids"].size(1) == K, "pad completions to K: the test needs a full-length one"
    inputs["completion_mask"] = (cols[None] < completion_lengths[:, None]).long()
    prompt_mask = inputs["prompt_mask"].clone()
    P = prompt_mask.size(1)
    for row, drop in enumerate([0, 3, 1, 5, 0, 2, 4, 6]):  # extra left padding per row
        first = int(prompt_mask[row].argmax())
        prompt_mask[row, : min(first + drop, P - 1)] = 0
    inputs["prompt_mask"] = prompt_mask
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    return inputs


def run_hook(trainer, inputs, padding_free):
    """Log-probs and entropies (no grad) through the trainer's hook, TRL's loss and its gradients."""
    trainer.padding_free = padding_free
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, K, compute_entropy=True)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return lp, ent, loss.detach(), grads


def count_packed_forwards(trainer, monkeypatch):
    """Counts the model forwards that receive one packed row ([1, N], position ids, no attention mask)."""
    calls = []
    real = type(trainer.model).__call__

    def spy(self, *a, **kw):
        if kw.get("position_ids") is not None and kw.get("attention_mask") is None and (
                "accel_labels" in kw or kw.get("fused_lm_head")):
            calls.append(kw["input_ids"].shape)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(trainer.model), "__call__", spy)
    return calls


# TRL's step outputs an off-policy producer (server mode, --rollout_budget) must reproduce when TRL's own trainer is
# fed the same rollouts: the loss, the gradient and TRL's importance-sampling correction
REPLAYED_KEYS = ("loss", "grad_norm", "sampling/importance_sampling_ratio/mean",
                 "sampling/sampling_logp_difference/max")


def assert_steps_equal(ours, reference) -> None:
    """Each logged step of `ours` equal to `reference`'s on REPLAYED_KEYS, and the LoRA adapters equal, bit for bit."""
    from support.compare import assert_equal

    mine = [h for h in ours.state.log_history if "loss" in h]
    theirs = [h for h in reference.state.log_history if "loss" in h]
    for key in REPLAYED_KEYS:
        assert [h[key] for h in mine] == [h[key] for h in theirs], key

    def adapter(trainer):
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}

    assert_equal(adapter(ours), adapter(reference))


# A short LoRA run that both sides of a comparison with TRL's own trainer build alike (test_carried_rollouts,
# test_dynamic_sampling): 8 rows in groups of 4, 16 completion tokens, 4 steps, no KL term; savers left to the caller
STEP_RUN = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=16, report_to="none", seed=0,
                beta=0.0, logging_steps=1, max_steps=4, save_steps=100, bf16=False)


def step_run_config(cls, tmp_path, **extra):
    """`cls` (TRL's GRPOConfig or ours) for STEP_RUN writing to tmp_path; `extra` overrides."""
    return cls(**dict(output_dir=str(tmp_path), **STEP_RUN) | extra)


def small_lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
