"""--vllm_mode server with a LoRA adapter (grpo_accel/generation/server_generation.py, issue 52) against the stand-in
server (support/vllm_standin.py): what the trainer asks the server for, when, with which adapter, and the steps it
takes with the answers, against TRL's own GRPOTrainer fed the same completions and behaviour log-probs.

The real server (its completions from the adapter just loaded, its log-probs the trainer's): the vLLM tier's
tests/vllm_engine/test_vllm_server.py."""

import pytest
import torch
from peft import LoraConfig
from support.rewards import length_reward
from support.trainers import assert_steps_equal
from support.vllm_standin import KEY, answer, serve

from grpo_accel.core.errors import UserError
from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model
from grpo_accel.generation.adapter_sync import API_KEY_ENV
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.trainer import GRPOAccelTrainer

# 3 prompts, 1 per generation batch (4 rows: its 4 completions): 3 steps per epoch, so step 4 starts the second epoch
PROMPTS, ROWS, G, STEPS, C = 3, 4, 4, 4, 6
# our savers off: the steps below are TRL's own code on both sides, so they must agree bit for bit
PLAIN = dict(logprob_impl="trl", padding_free=False, share_prompt="false")


def config(cls, tmp_path, url, **extra):
    return cls(**dict(output_dir=str(tmp_path), per_device_train_batch_size=ROWS, num_generations=G,
                      max_completion_length=C, report_to="none", seed=0, beta=0.0, logging_steps=1, max_steps=STEPS,
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30) | extra)


def ours(tmp_path, url, dtype=torch.float32, reward=length_reward, **extra):
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama", dtype=dtype)
    return GRPOAccelTrainer(model=model, reward_funcs=[reward], args=config(GRPOAccelConfig, tmp_path, url,
                            **PLAIN, **extra), processing_class=tokenizer,
                            train_dataset=arithmetic_dataset("train", PROMPTS),
                            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def recording(trainer) -> list:
    """What the trainer's generation hands TRL, batch by batch."""
    gen, seen = trainer.vllm_generation, []
    generate = gen.generate

    def record(prompts, images=None, num_generations=1, profiler=None):
        out = generate(prompts, images, num_generations, profiler)
        seen.append(([list(p) for p in prompts], out))
        return out

    gen.generate = record
    return seen


class Replay:
    """TRL's `vllm_generation` for TRL's own trainer: hands back what our run got, batch by batch, checking that TRL
    asks for the same prompts."""

    def __init__(self, seen):
        self.seen = list(seen)

    def sync_weights(self):
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        asked, out = self.seen.pop(0)
        assert [list(p) for p in prompts] == asked, "TRL's run asked for other prompts than ours"
        return out


def trls(tmp_path, seen):
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    args = config(GRPOConfig, tmp_path, "http://unused", bf16=False)  # ours defaults to it off the GPU
    args.use_vllm = False  # no NCCL client: the replay below is its generation, TRL's correction on
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                          train_dataset=arithmetic_dataset("train", PROMPTS),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args.use_vllm = trainer.use_vllm = True
    trainer.vllm_mode, trainer.vllm_generation, trainer._last_loaded_step = "server", Replay(seen), -1
    return trainer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    with serve() as (url, handler):
        yield url, handler


def test_steps_ahead_equal_trls_trainer_fed_the_same_rollouts(server, tmp_path):
    """max_staleness 1: after the first step, each batch was asked for one step early and sampled with the adapter
    of the step before (what the server holds while the trainer trains); TRL's own trainer, fed the same completions
    and behaviour log-probs, takes the same steps with its importance-sampling correction (bit for bit: both run
    TRL's code, our savers off). Step 4 opens the second epoch: nothing was read ahead across it, so it samples then."""
    url, handler = server
    trainer = ours(tmp_path / "ours", url, max_staleness=1)
    seen = recording(trainer)
    trainer.train()
    # (adapter, unique prompts) per request, in arrival order: batch 1 with v0, then each next batch ahead with the
    # adapter of the step that asked, the epoch's start synchronous with its own
    batches = [asked[::G] for asked, _ in seen]
    models = [model for model, _ in handler.requests]
    name = trainer.vllm_generation.sync.name_of
    assert models[:4] == [name(0), name(0), name(1), name(3)], models
    assert [prompts for _, prompts in handler.requests[:4]] == batches
    # what TRL got is what the server sent for that batch, by the adapter that sampled it: its tokens and its
    # behaviour log-probs (TRL keeps a token's first log-prob), in the server's order, G per prompt
    sampled_by = [name(0), name(0), name(1), name(3)]
    for (asked, (prompt_ids, completion_ids, logps, _)), model in zip(seen, sampled_by, strict=True):
        sent = [answer(model, p, i, C) for p in asked[::G] for i in range(G)]
        assert prompt_ids == asked and completion_ids == [ids for ids, _ in sent]
        assert [[lp[0] for lp in row] for row in logps] == [lps for _, lps in sent]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["server/batches_ahead_frac"] for h in logs] == [0.0, 1.0, 1.0, 0.0]
    assert [h["server/staleness"] for h in logs] == [0.0, 1.0, 1.0, 0.0]
    assert all(h["server/dropped_batches"] == 0 for h in logs)
    assert "sampling/importance_sampling_ratio/mean" in logs[1]  # TRL's correction ran on the stale batches

    reference = trls(tmp_path / "trl", seen)
    reference.train()
    assert_steps_equal(trainer, reference)


def test_staleness_zero_is_synchronous(server, tmp_path):
    """max_staleness 0: every batch asked for when it is generated, with the adapter of the step training on it."""
    url, handler = server
    trainer = ours(tmp_path, url, max_staleness=0, max_steps=2)
    trainer.train()
    name = trainer.vllm_generation.sync.name_of
    assert [model for model, _ in handler.requests] == [name(0), name(1)]
    assert sorted(handler.loaded) == [name(1)]  # the server keeps one version: nothing samples ahead
    assert trainer.vllm_generation.sync.dtype == torch.float32  # an fp32 base: the adapter's files as PEFT saves them


def test_a_bf16_bases_adapter_goes_out_in_bf16(server, tmp_path):
    """The trainer hands the sync its base's dtype (adapter_sync.base_dtype): PEFT's fp32 adapter over a bf16 base is
    written in bf16, what vLLM would cast it to on load (tests/test_adapter_sync.py has the files)."""
    url, _ = server
    trainer = ours(tmp_path, url, dtype=torch.bfloat16)
    assert trainer.vllm_generation.sync.dtype == torch.bfloat16


def test_a_batch_not_asked_for_or_too_old_is_dropped_and_sampled_again(server, tmp_path):
    url, handler = server
    trainer = ours(tmp_path, url, max_staleness=1, max_steps=1)
    gen = trainer.vllm_generation
    gen.sync_weights()  # v0 on the server
    prompts = [[1, 2, 3]] * G
    gen.submit([[9, 9]] * G, G)  # asked ahead for a batch that never comes
    out = gen.generate(prompts, None, G)
    assert gen.stats["dropped_batches"] == 1 and gen.stats["ahead"] == 0 and len(out[1]) == G
    assert [p for _, p in handler.requests] == [[[9, 9]], [[1, 2, 3]]]
    gen.submit(prompts, G)  # asked with v0 ...
    trainer.state.global_step = 2  # ... and collected two steps later: past max_staleness 1
    gen.generate(prompts, None, G)
    assert gen.stats["dropped_batches"] == 2 and handler.requests[-1][0] == gen.sync.name_of(0)


def test_an_evaluation_leaves_the_batch_asked_ahead(server, tmp_path):
    """TRL's evaluation generates between training steps: its prompts are sampled at once, and the batch asked for
    ahead stays for the step it was asked for (not dropped as a batch nobody asked for)."""
    url, handler = server
    trainer = ours(tmp_path, url, max_staleness=1, max_steps=1)
    gen = trainer.vllm_generation
    gen.sync_weights()
    ahead = [[5, 6, 7]] * G
    gen.submit(ahead, G)
    trainer.model.eval()
    gen.generate([[1, 2]] * G, None, G)
    trainer.model.train()
    gen.generate(ahead, None, G)
    assert gen.stats["ahead"] == 1 and gen.stats["dropped_batches"] == 0
    assert [p for _, p in handler.requests] == [[[5, 6, 7]], [[1, 2]]]  # the batch ahead was not asked twice


def test_a_wrong_key_stops_before_the_first_step(server, tmp_path, monkeypatch):
    url, _ = server
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    with pytest.raises(UserError, match=API_KEY_ENV + " does not match"):
        ours(tmp_path, url)


@pytest.mark.parametrize("option", [dict(generation_kwargs={"seed": 1}), dict(vllm_structured_outputs_regex=r"\d+"),
                                    dict(weight_sync_steps=2, max_staleness=1), dict(rollout_budget=4)])
def test_options_the_client_does_not_send_are_refused(server, tmp_path, option):
    """And an adapter loaded every 2 steps with max_staleness 1: every other batch would come out too old; and
    --rollout_budget, whose rounds are the trainer's own routes' (the server samples ahead by itself)."""
    from grpo_accel.core.errors import ConfigError

    url, _ = server
    with pytest.raises(ConfigError, match="not sent to the server|past --max_staleness 1|already samples ahead"):
        ours(tmp_path, url, **option)


def test_dynamic_sampling_refills_now_and_keeps_the_batch_asked_ahead(server, tmp_path):
    """--dynamic_sampling with the next batch asked for ahead (max_staleness 1): a refill round is sampled then,
    with this step's adapter, and the batch asked for ahead stays queued for the step it is for (taken by a refill,
    it would be dropped as not its prompts and sampled again). half_flat_reward: a group of an even answer is flat."""
    from support.rewards import half_flat_reward

    url, _ = server
    trainer = ours(tmp_path, url, reward=half_flat_reward, max_staleness=1, dynamic_sampling=True,
                   max_sampling_rounds=3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert any(h["dynamic_sampling/rounds"] > 1 for h in logs), "no refill: the test would test nothing"
    assert all(h["server/dropped_batches"] == 0 for h in logs), logs
    # the steps after the first whose batch was asked for ahead (not an epoch's first) found it there
    assert sum(h["server/batches_ahead_frac"] > 0 for h in logs) == 2
