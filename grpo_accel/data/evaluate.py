"""Held-out evaluation: greedy decoding; strict and lenient accuracy for question/answer rows (the run scores
prompt datasets with its rewards: app/runner.py).

    python -c "from grpo_accel.data.evaluate import evaluate; ..."  # used by launch/train.py before and after training
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from grpo_accel.data.rewards import accuracy


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 64,
                    batch_size: int = 32, desc: str = "eval", disable_progress: bool = False,
                    synced_gpus: bool = False) -> list[str]:
    """Greedy completions for prompts (chat messages through the chat template, text as it is, as TRL renders
    them), batched with left padding."""
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    texts = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=disable_progress):
            chunk = prompts[start:start + batch_size]
            rendered = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                        if isinstance(p, list) else p for p in chunk]
            # a chat template writes its own special tokens; TRL tokenizes text prompts with them added
            enc = tokenizer(rendered, return_tensors="pt", padding=True,
                            add_special_tokens=not isinstance(chunk[0], list)).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id, synced_gpus=synced_gpus)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return texts


def evaluate(model, tokenizer, dataset, **kwargs) -> tuple[dict[str, float], list[dict]]:
    """(accuracy dict, per-problem records) on a dataset with `prompt` and `answer` columns."""
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    texts = generate_greedy(model, tokenizer, prompts, **kwargs)
    records = [{"question": p[-1]["content"], "answer": a, "completion": t} for p, a, t in zip(prompts, answers, texts)]
    return accuracy(texts, answers), records
