"""TRL 1.16 GRPOTrainer generating through the shared engine (attach_shared_vllm): one real GRPO step."""

import pytest

pytest.importorskip("vllm.sampling_params")
pytest.importorskip("trl")
pytestmark = pytest.mark.vllm

from conftest import report  # noqa: E402

from grpo_accel.generation import vllm_colocate as vc  # noqa: E402
from grpo_accel.trainer.generation_modes import attach_shared_vllm  # noqa: E402  (it writes TRL state: trainer/)


def test_grpo_step_generates_through_shared_engine(engine, tokenizer, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    model = engine.build_training_model()
    assert engine.shared
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj", "up_proj"]))
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=12, max_steps=2, learning_rate=1e-2,
                      report_to=[], logging_steps=1, gradient_checkpointing=False, bf16=False, save_strategy="no")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + 3?"}] for a in range(8)]})
    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        return [float(len(c[0]["content"]) % 5) for c in completions]  # any non-constant reward

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer)
    generation = attach_shared_vllm(trainer, engine)
    pushes = []
    original_push = engine.push_adapter
    engine.push_adapter = lambda m, **kw: (pushes.append(trainer.state.global_step), original_push(m, **kw))[1]
    try:
        trainer.train()
    finally:
        engine.push_adapter = original_push
    assert calls and pushes == [0, 1], pushes  # one adapter push per optimizer step, before its generation
    # The engine's base is still the training model's base (shared, never merged into).
    assert vc.shared_fraction(trainer.model, engine.llm) > 0.95
    # Push the adapter after the last step: engine and trainer agree on a fixed sequence.
    generation.sync_weights()
    ids = tokenizer("What is 5 + 3? The answer is 8.")["input_ids"]
    err = (engine.prompt_logprobs(ids) - vc.hf_token_logprobs(trainer.model, ids)).abs().max().item()
    report(f"after 2 GRPO steps through TRL: engine vs trainer log-probs max |diff| {err:.2e}")
    assert err < 1e-4
