"""Sampling groups from a `vllm serve` process into versioned rollout records (issue 52's producer;
docs/off-policy-rollouts.md).

One request per batch: OpenAI's `/v1/completions` with the prompts as token ids, `n` = G completions each, the
policy version's adapter as the model (`policy-<run>-v{n}`, loaded by adapter_sync.AdapterSync), `logprobs: 0` (the
sampled token's own log-prob) and `return_token_ids` (ids, not text: what the trainer scores). vLLM lists the
choices prompt by prompt, G each (entrypoints/openai/completion/serving.py appends them in that order). The
log-probs are the behaviour policy's only when the server runs with `--logprobs-mode processed_logprobs` (after
temperature and top-k/top-p, as TRL's async trainer starts it); vLLM's default is the raw model's.
"""

from __future__ import annotations

import json

from grpo_accel.core.errors import UserError
from grpo_accel.generation.adapter_sync import server_request
from grpo_accel.generation.rollouts import Rollout, RolloutGroup


def sample_groups(base_url: str, model: str, version: int, prompts: list[list[int]], num_generations: int,
                  max_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0, repetition_penalty: float = 1.0, inputs: list[dict] | None = None,
                  first_group_id: int = 0, api_key: str | None = None,
                  timeout_s: float = 600.0) -> list[RolloutGroup]:
    """G completions of each prompt from the server's `model` (the adapter of policy `version`), as RolloutGroups
    whose every token carries `version` and its behaviour log-prob."""
    body = {"model": model, "prompt": prompts, "n": num_generations, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,  # vllm_generation's rule
            "repetition_penalty": repetition_penalty, "logprobs": 0, "return_token_ids": True}
    status, text = server_request(base_url, "/v1/completions", body, api_key, timeout_s)
    if status != 200:
        raise UserError(f"the vLLM server at {base_url} refused the completions of {model} (HTTP {status}: "
                        f"{text.strip()[:300]})")
    reply = json.loads(text)
    choices = reply["choices"]
    if len(choices) != len(prompts) * num_generations:
        raise RuntimeError(f"{len(choices)} choices for {len(prompts)} prompts x {num_generations}")
    groups = []
    for p, prompt in enumerate(prompts):
        rollouts = []
        for choice in choices[p * num_generations:(p + 1) * num_generations]:
            ids, logps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            r = Rollout()
            # a NaN log-prob comes back as null: TRL maps it to NaN and gives its token no correction; so do we
            r.extend(ids, [float("nan") if x is None else x for x in logps], version,
                     finished=choice["finish_reason"] in ("stop", "length"))
            rollouts.append(r)
        groups.append(RolloutGroup(first_group_id + p, list(prompt), rollouts, dict(inputs[p]) if inputs else {}))
    return groups


__all__ = ["sample_groups"]
