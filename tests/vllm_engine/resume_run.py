"""Resume with the colocated engine, one phase per process (one engine per process); prints one JSON line.

    python tests/vllm_engine/resume_run.py train  OUT [MODEL_DIR]  # 2 GRPO steps, shared LoRA, checkpoint-2 saved
    python tests/vllm_engine/resume_run.py resume OUT [MODEL_DIR]  # a fresh engine and trainer, from OUT/checkpoint-2

MODEL_DIR: a saved model (default: the embedded SmolLM2; the test passes conftest.tiny_vllm_model's).

At the resumed run's first generation the engine must already hold the resumed adapter: a fresh engine holds the
bare base, and a run that skipped the push would sample its first batch from the base model while the trainer
scores it with the adapter (TRL #3148). Recorded there: engine vs trainer log-probs on a fixed sequence with the
engine's adapter, and without it (what a skipped push would generate from).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_run import FIXED, reward_digits  # noqa: E402


def main() -> None:
    phase, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(int(os.environ.get("GRPO_ACCEL_VLLM_THREADS", "1")))
    from peft import LoraConfig

    from grpo_accel.data.datasets import train_eval_datasets
    from grpo_accel.data.models import embedded_model_dir, load_tokenizer
    from grpo_accel.generation import vllm_colocate as vc
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    model_dir = sys.argv[3] if len(sys.argv) > 3 else str(embedded_model_dir())
    tokenizer = load_tokenizer(model_dir)
    train, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config = GRPOAccelConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], use_vllm=True, vllm_mode="colocate",
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
        max_steps=2 if phase == "train" else 3, learning_rate=2e-3, logging_steps=1, save_steps=2,
        gradient_checkpointing=False, temperature=0.7, seed=0, model_init_kwargs={"dtype": "float32"})
    trainer = GRPOAccelTrainer(model=model_dir, reward_funcs=reward_digits, args=config, train_dataset=train,
                               processing_class=tokenizer, peft_config=lora)
    engine = trainer.vllm_engine
    ids = tokenizer(FIXED)["input_ids"]
    result = {"phase": phase, "shared": engine.shared}

    def diffs(tag):
        model = trainer.accelerator.unwrap_model(trainer.model)
        reference = vc.hf_token_logprobs(model, ids)
        result[f"{tag}_with_engine_adapter"] = (
            (engine.prompt_logprobs(ids, use_adapter=engine.has_adapter) - reference).abs().max().item())
        result[f"{tag}_bare_base"] = (engine.prompt_logprobs(ids, use_adapter=False) - reference).abs().max().item()

    if phase == "resume":
        original, seen = engine.generate, []

        def first_generation_checked(*args, **kwargs):
            if not seen:  # before the engine samples anything for the resumed run
                seen.append(trainer.state.global_step)
                diffs("first_generation")
            return original(*args, **kwargs)

        engine.generate = first_generation_checked
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2") if phase == "resume" else None)
    result["global_step"] = trainer.state.global_step
    result["steps_logged"] = [h["step"] for h in trainer.state.log_history if "loss" in h]
    if phase == "resume":
        result["first_generation_at_step"] = seen[0] if seen else None
        result["push_slope_bytes_per_100"] = push_slope(engine, trainer.accelerator.unwrap_model(trainer.model))
    print("RESUME_RUN " + json.dumps(result), flush=True)


def push_slope(engine, peft_model, pushes: int = 120, window: int = 100) -> float:
    """The in-memory adapter push after every optimizer step, repeated: bytes malloc holds, fitted per 100 pushes
    over the last `window` (each push builds a LoRAModel of the whole adapter; a kept reference leaks all of it)."""
    import gc

    from support.memory import fit_slope, malloc_in_use_bytes

    samples = []
    for _ in range(pushes):
        engine.push_adapter(peft_model)
        gc.collect()
        samples.append(float(malloc_in_use_bytes()))
    return fit_slope(samples[-window:])[0] * 100


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # vLLM's and the stack's teardown is seconds of a core per process
