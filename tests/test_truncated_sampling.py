"""Truncated sampling, one distribution (issue 65 item 3; grpo_accel/ops/truncation.py, docs/off-policy-rollouts.md
"Truncated sampling"): a sampler with top_k / top_p / min_p reports the truncated, renormalised log-prob; the behaviour
log-prob plus the trainer's log Z (the full tempered distribution's mass on the sampler's support) is the full
distribution's, so TRL's importance ratio is 1 on-policy instead of the kept mass.

References that are not our rule's code: transformers' own logits warpers (TopK, TopP, MinP: the same comparisons vLLM
0.32's sampler makes, applied in vLLM's order or transformers'), and float64 over the full vocabulary.
"""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_accel.ops.truncation import Truncation, kept_mask, log_kept_mass, log_kept_mass_reference

N, H, V, T = 300, 32, 512, 0.7
CASES = {  # each rule alone, then together; min_p 0.1 with top_p 0.9 is where the two orders' supports differ
    "top_k": Truncation(top_k=20), "top_p": Truncation(top_p=0.9), "min_p": Truncation(min_p=0.05),
    "all_vllm": Truncation(top_k=60, top_p=0.9, min_p=0.1, min_p_first=True),
    "all_transformers": Truncation(top_k=60, top_p=0.9, min_p=0.1, min_p_first=False),
}


def inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5  # logits std ~2.8: a few hundred tokens matter
    return hidden.to(dtype), weight.to(dtype)


def warpers_mask(z: torch.Tensor, t: Truncation) -> torch.Tensor:
    """The support as transformers' warpers compute it, in the sampler's order (vLLM: min_p first)."""
    steps = ([TopKLogitsWarper(t.top_k)] if t.top_k else []) + ([TopPLogitsWarper(t.top_p)] if t.top_p < 1 else [])
    min_p = [MinPLogitsWarper(t.min_p)] if t.min_p else []
    processors = LogitsProcessorList(min_p + steps if t.min_p_first else steps + min_p)
    return processors(torch.zeros(z.shape[0], 1, dtype=torch.long), z.clone()).isfinite()


@pytest.mark.parametrize("name", CASES)
def test_the_support_is_the_samplers(name):
    hidden, weight = inputs()
    z = hidden @ weight.T / T
    assert torch.equal(kept_mask(z, CASES[name]), warpers_mask(z, CASES[name]))


def test_the_two_orders_keep_different_supports():
    """vLLM's min_p before top_p and transformers' after it are different rules on these logits (so a route given
    the other sampler's order would get the wrong Z: the test above checks each against its own)."""
    z = (lambda h, w: h @ w.T / T)(*inputs())
    assert not torch.equal(kept_mask(z, CASES["all_vllm"]), kept_mask(z, CASES["all_transformers"]))


@pytest.mark.parametrize("name", CASES)
def test_the_corrected_ratio_is_one_on_policy_where_the_uncorrected_sits_at_the_kept_mass(name):
    """float64 reference: tokens sampled from the truncated renormalised distribution (the warpers' support), their
    behaviour log-prob the truncated one; the trainer's the full tempered distribution's. TRL's ratio exp(old -
    behaviour) averages the kept mass; with our log Z (chunked, fp32 inputs) added to the behaviour it is 1."""
    t = CASES[name]
    hidden, weight = inputs()
    z = hidden @ weight.T / T
    support = warpers_mask(z, t)
    truncated = z.masked_fill(~support, float("-inf")).log_softmax(-1)
    tokens = torch.multinomial(truncated.exp(), 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    behaviour = truncated.gather(1, tokens[:, None]).squeeze(1)
    full = z.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    kept = z.softmax(-1).masked_fill(~support, 0).sum(1)
    uncorrected = torch.exp(full - behaviour)
    assert kept.mean() < 0.97, f"{name}: kept mass {kept.mean():.3f}, too close to 1 to tell the two apart"
    assert abs(uncorrected.mean() / kept.mean() - 1) < 1e-9
    log_z = log_kept_mass(hidden.float(), weight.float(), t, temperature=T, chunk_size=64).double()
    corrected = torch.exp(full - (behaviour + log_z))
    assert abs(corrected.mean() - 1) < 0.01, (name, corrected.mean())
    assert abs(uncorrected.mean() - 1) > 0.03


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("name", CASES)
def test_chunked_log_kept_mass_is_float64s_within_fp32s_own_error(name, softcap):
    """Rows in chunks of 64 and of 7 (N = 300 divides by neither) against the float64 full-vocabulary reference;
    the bound is plain fp32's own error (the full-logits reference in fp32) against float64, measured here."""
    t = CASES[name]
    h64, w64 = inputs(seed=2)
    exact = log_kept_mass_reference(h64, w64, t, temperature=T, softcap=softcap)
    plain = log_kept_mass_reference(h64.float(), w64.float(), t, temperature=T, softcap=softcap).double()
    bound = 2 * (plain - exact).abs().max().item() + torch.finfo(torch.float32).eps
    for chunk in (64, 7, None):
        ours = log_kept_mass(h64.float(), w64.float(), t, temperature=T, softcap=softcap, chunk_size=chunk)
        assert ours.dtype == torch.float32 and ours.shape == (N,)
        err = (ours.double() - exact).abs().max().item()
        assert err <= bound, (name, chunk, err, bound)
    assert exact.min() < -0.01  # something was cut: log Z is not trivially 0


def test_off_is_exactly_zero_and_computes_nothing():
    hidden, weight = inputs(torch.float32)
    out = log_kept_mass(hidden, weight[:, :3], Truncation(), temperature=T)  # wrong shapes: never multiplied
    assert torch.equal(out, torch.zeros(N))


# --- through the trainer: --rollout_budget over transformers' continuous batching, which records each carried token's
# truncated log-prob (transformers' `return_logprobs`: the log-softmax of the processed scores)

PROMPTS, ROWS, G, STEPS, C = 16, 8, 4, 4, 16
EOS_IDS = list(range(1000, 11000))  # as test_carried_rollouts: lengths vary, so completions are carried


def old_logps_recorded(monkeypatch) -> list[bool]:
    """Per scored batch: whether the old log-probs TRL's loss gets are the old pass's own, bit for bit (the hook
    called again on the same rows, outside TRL's method: nothing subtracted)."""
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    seen, real = [], GRPOAccelTrainer._generate_and_score_completions

    def record(trainer, inputs):
        out = real(trainer, inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            again, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, out["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size)
        seen.append(torch.equal(again, out["old_per_token_logps"]))
        return out

    monkeypatch.setattr(GRPOAccelTrainer, "_generate_and_score_completions", record)
    return seen


def budget_run(tmp_path, padding_free, **extra):
    from peft import LoraConfig
    from support.rewards import length_reward

    from grpo_accel.data.datasets import arithmetic_dataset
    from grpo_accel.data.models import load_model
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=ROWS, num_generations=G,
                           max_completion_length=C, report_to="none", seed=0, beta=0.0, logging_steps=1,
                           max_steps=STEPS, save_steps=100, bf16=False, logprob_impl="chunked",
                           padding_free=padding_free, share_prompt="false", use_transformers_continuous_batching=True,
                           transformers_continuous_batching_config=dict(num_blocks=32, page_size=32,
                                                                        max_batch_tokens=256),
                           rollout_budget=2, max_staleness=STEPS, learning_rate=0.0, **extra)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                               train_dataset=arithmetic_dataset("train", PROMPTS),
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.generation_config.eos_token_id = [tokenizer.eos_token_id, *EOS_IDS]
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_top_p_on_policy_ratio_is_one_through_a_budgeted_run(tmp_path, monkeypatch, padding_free):
    """learning rate 0: every step's policy is the sampler's, so each carried token (its behaviour log-prob recorded
    by transformers' continuous batching under top_p 0.9, fp32) must get ratio 1; TRL 1.16's ratio there is the
    kept mass (mean 0.70 over a step's tokens here). Tokens this step sampled get NaN (ratio exactly 1). The loss's
    old log-probs stay the full distribution's, bit for bit."""
    same_old = old_logps_recorded(monkeypatch)
    logs = budget_run(tmp_path, padding_free, top_p=0.9)
    assert len(same_old) == STEPS and all(same_old), same_old
    assert max(h["rollouts/carried_completions"] for h in logs) > 0, "nothing carried: no ratio was tested"
    low = [h["sampling/importance_sampling_ratio/min"] for h in logs]
    high = [h["sampling/importance_sampling_ratio/max"] for h in logs]
    assert min(low) < 1.0 or max(high) > 1.0, "every ratio exactly 1: no carried token was corrected"
    for h in logs:
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 0.01, h
        assert 0.99 < h["sampling/importance_sampling_ratio/min"] <= h["sampling/importance_sampling_ratio/max"] < 1.01


def test_each_route_reads_its_samplers_truncation():
    """The rule and the values come from where each sampler reads them: transformers' continuous batching under a
    budget from the generation config, in its order (min_p last); vLLM from TRL's sampling options with
    generation_kwargs over them, min_p first; nothing without a ratio or without truncation."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from grpo_accel.trainer.carried_rollouts import BudgetMode
    from grpo_accel.trainer.truncated_sampling import sampler_truncation

    def trainer(mode, use_vllm=True, correction=True, generation_kwargs=None, **sampling):
        options = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0) | sampling
        args = SimpleNamespace(vllm_importance_sampling_correction=correction, max_completion_length=8,
                               generation_kwargs=generation_kwargs, **options)
        return SimpleNamespace(args=args, use_vllm=use_vllm, generation_mode=mode,
                               generation_config=GenerationConfig(do_sample=True, **options))

    budget_cb = BudgetMode.__new__(BudgetMode)
    budget_cb.engine_rounds = False
    engine = object()  # a vLLM route's mode: colocated, server, or a budget over colocated vLLM
    assert sampler_truncation(trainer(budget_cb, top_p=0.9, min_p=0.1, top_k=20)) == Truncation(
        top_k=20, top_p=0.9, min_p=0.1, min_p_first=False)
    assert sampler_truncation(trainer(engine, top_p=0.9, min_p=0.1)) == Truncation(top_p=0.9, min_p=0.1)
    assert sampler_truncation(trainer(engine, generation_kwargs={"top_k": 5})) == Truncation(top_k=5)
    assert sampler_truncation(trainer(engine, min_p=0.05)) == Truncation(min_p=0.05)
    assert sampler_truncation(trainer(engine)) is None
    assert sampler_truncation(trainer(engine, top_p=0.9, correction=False)) is None
    assert sampler_truncation(trainer(budget_cb, top_p=0.9, use_vllm=False)) is None
