"""The drop-in promise, checked option by option: the same GRPO steps through TRL's GRPOTrainer and through ours (same
seed, same tiny model, fp32) give the same logged metrics and the same parameter update, for every option set of
grpo_accel/trainer/trl_compat.py's matrix, with our savers on: the fused head, padding-free packing, activation
offload (its real copy path, forced on CPU), sequence tiles of 16 tokens (every row is longer) and each prompt once
per group (share_prompt="true": "auto" would leave the short plain-text prompts unshared).

The optimizer is plain SGD, so each parameter's update is the learning rate times its gradient: equal updates are
equal gradients (Adam would normalise a gradient error away). Metrics: every key TRL logs, ours included, equal
to 1e-5 relative (times and throughput aside). Updates: ||ours - TRL's|| <= 1e-5 ||TRL's|| over all parameters.
A TRL upgrade that adds a GRPOConfig field fails `test_every_grpo_config_field_is_named`.

    OMP_NUM_THREADS=1 pytest tests/test_trl_compat.py -q
"""

import dataclasses
import json

import pytest
import torch
from support.rewards import length_reward
from support.trl_matrix import NOT_COMPARED, SAVERS_ON, close
from trl import GRPOConfig, GRPOTrainer

from grpo_accel import GRPOAccelConfig, GRPOAccelTrainer
from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.trainer import trl_compat


def digit_share(prompts, completions, **kwargs):
    """A second reward: the share of digits in the completion (differs from length_reward per completion)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


async def async_length(prompts, completions, **kwargs):
    return length_reward(prompts, completions)


def every_other_none(prompts, completions, **kwargs):
    """Applies to every other completion only (None: does not apply), beside a reward that applies to all."""
    return [None if i % 2 else r for i, r in enumerate(length_reward(prompts, completions))]


def tiny_reward_model(tokenizer):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from grpo_accel.planning.architectures import TINY_CONFIGS

    spec = dict(TINY_CONFIGS["tiny-llama"])
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer), num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id, **spec)
    torch.manual_seed(7)
    return AutoModelForSequenceClassification.from_config(config)


def scripted_rollout(prompts, trainer):
    """A rollout_func (TRL's multi-turn hook) that plays a fixed transcript per prompt: 4-9 "model" tokens with an
    environment's 3-token reply inside, marked by env_mask = 0 (context for the next tokens, never loss)."""
    import random

    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completion_ids, env_mask = [], []
    for i, p in enumerate(prompts):
        rng = random.Random(f"{i}:{p}")
        n = rng.randint(4, 9)
        completion_ids.append([rng.randrange(100, 40000) for _ in range(n)])
        env_mask.append([0 if 1 <= j <= 3 else 1 for j in range(n)])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids], "env_mask": env_mask}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Calculator:
    """An environment (TRL's environment_factory): `multiply` is its tool, and it owns the reward (tool calls made)."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls)


def scripted_tool_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """GRPOTrainer._generate_single_turn for the tool cases: a random tiny model never writes a well-formed tool call,
    so each turn is scripted from its prompt (the same in both trainers): a `multiply` call in Qwen3's format while
    the transcript has fewer than two tool responses (60%), else 2-5 random tokens; each turn ends with <|im_end|>.
    TRL's own loop parses the calls, runs the tools and appends their responses (tool_mask 0: context, not loss)."""
    import random

    tokenizer = self.processing_class
    turns = []
    for i, ids in enumerate(prompt_ids):
        rng = random.Random(sum(ids) * 31 + len(ids) * 7 + i)
        if tokenizer.decode(ids).count("<tool_response>") < 2 and rng.random() < 0.6:
            arguments = {"a": rng.randint(2, 9), "b": rng.randint(2, 9)}
            call = "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": arguments}) + "\n</tool_call>"
            turn = tokenizer(call, add_special_tokens=False)["input_ids"]
        else:
            turn = [rng.randrange(100, 30000) for _ in range(rng.randint(2, 5))]
        turns.append(turn + [tokenizer.eos_token_id])
    return turns, None


REWARDS = {"length": [length_reward], "two": [length_reward, digit_share],
           "kinds": [async_length, every_other_none, digit_share]}


def trl_library_rewards():
    """TRL's own documented rewards for conversational math: the <think> format, a soft overlong punishment and an
    n-gram repetition penalty (trl.rewards); with length_reward beside them, as a random tiny model's samples earn
    the same from each of those three (no advantage, nothing to compare)."""
    from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment, think_format_reward

    return [think_format_reward, get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
            get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0), length_reward]

# id -> how the case differs from the base run (GRPOConfig `args`, `steps`, `rewards`, `peft`, `model` given by
# path, a plain-text `dataset`, an `eval` dataset, `eos_often`: completions that end before the length cap,
# `rollout`: scripted_rollout as TRL's rollout_func, `tools`: multiply as a tool or Calculator as the environment).
# grpo_accel/trainer/trl_compat.py's FIELDS names these ids.
CASES = {
    "default": {},  # TRL's defaults: loss_type "dapo", scale_rewards "group", token-level importance sampling
    **{f"loss_{t}": {"args": {"loss_type": t}} for t in ("grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo",
                                                          "vespo")},
    "sequence_is_batch_scale": {"args": {"loss_type": "grpo", "importance_sampling_level": "sequence",
                                         "scale_rewards": "batch"}},
    "truncation_entropy_quantile": {"eos_often": True, "args": {"mask_truncated_completions": True,
                                                                "top_entropy_quantile": 0.5, "scale_rewards": "none"}},
    "iterations_entropy": {"steps": 2, "args": {"num_iterations": 2, "steps_per_generation": 2, "delta": 1.5,
                                                "epsilon_high": 0.28, "off_policy_mask_threshold": 0.5,
                                                "entropy_coef": 0.01, "use_adaptive_entropy": True}},
    "kl_lora": {"peft": True, "args": {"beta": 0.04}},
    "kl_full_reference": {"model": "path", "args": {"beta": 0.04, "use_bias_correction_kl": False,
                                                    "model_init_kwargs": {"dtype": "float32"}}},
    "sync_reference": {"model": "path", "steps": 2, "args": {"beta": 0.04, "sync_ref_model": True,
                                                             "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}},
    "reward_kinds": {"rewards": "kinds"},  # an async reward, one that is None for every other completion, a sync one
    "normalize_then_sum": {"rewards": "two", "args": {"multi_objective_aggregation": "normalize_then_sum"}},
    "trl_library_rewards": {"rewards": "trl_library", "args": {"reward_weights": [1.0, 0.5, 0.5, 1.0]}},
    "reward_model_plain_text": {"rewards": "model", "dataset": "plain"},
    "chat_kwargs_fp32_head": {"args": {"chat_template_kwargs": {"enable_thinking": False},
                                       "cast_lm_head_to_fp32": True}},
    "evaluation": {"eval": True, "args": {"eval_strategy": "steps", "eval_steps": 1, "num_generations_eval": 2,
                                          "per_device_eval_batch_size": 4}},
    "sampling": {"args": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                          "min_p": 0.05, "generation_kwargs": {"min_new_tokens": 1}, "pad_to_multiple_of": 8,
                          "generation_batch_size": 8, "shuffle_dataset": False, "disable_dropout": True}},
    "rollout_env_mask": {"dataset": "plain", "rollout": True},
    # Qwen3's chat template (TRL ships it) on the tiny model's tokenizer; generation scripted (scripted_tool_turn)
    "tools": {"tools": "functions", "args": {"max_completion_length": 64, "max_tool_calling_iterations": 1}},
    "environment_rewards": {"tools": "environment", "rewards": None, "args": {"max_completion_length": 64}},
}


def plain_text(dataset):
    """The same prompts as plain strings (a standard, not conversational, dataset)."""
    return dataset.map(lambda row: {"prompt": row["prompt"][-1]["content"]})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """tiny-llama saved once: cases that need TRL to load the model (and its reference copy) by path."""
    tokenizer = load_tokenizer("tiny-llama")
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model("tiny-llama", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run(trainer_cls, config_cls, case, out, tiny_dir):
    tokenizer = load_tokenizer("tiny-llama")
    model = tiny_dir if case.get("model") == "path" else build_tiny_model("tiny-llama", tokenizer)
    if case.get("eos_often"):  # a large end-of-sequence row (it is the zeroed pad row): some completions end early
        with torch.no_grad():
            row = model.get_output_embeddings().weight[tokenizer.eos_token_id]
            row.copy_(10 * torch.randn(row.shape, generator=torch.Generator().manual_seed(3)))
    train = arithmetic_dataset("train", 8)
    extra = {}
    if case.get("dataset") == "plain":
        train = plain_text(train)
    if case.get("rollout"):
        extra["rollout_func"] = scripted_rollout
    if case.get("eval"):
        extra["eval_dataset"] = arithmetic_dataset("test", 4)
    if case.get("tools"):
        from trl.chat_template_utils import qwen3_chat_template

        tokenizer.chat_template = qwen3_chat_template  # SmolLM2's template cannot render tool calls (TRL refuses it)
        if case["tools"] == "functions":
            extra["tools"] = [multiply]
        else:
            extra["environment_factory"] = Calculator
    rewards = case.get("rewards", "length")
    if rewards is None:  # the environment owns the reward
        pass
    elif rewards == "trl_library":
        rewards = trl_library_rewards()
    elif rewards != "model":
        rewards = REWARDS[rewards]
    else:
        rewards, extra["reward_processing_classes"] = [tiny_reward_model(tokenizer)], [tokenizer]
    if case.get("peft"):
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    args = dict(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                report_to="none", seed=0, bf16=False, use_cpu=True, logging_steps=1, save_strategy="no",
                max_steps=case.get("steps", 1), optim="sgd", learning_rate=0.1, gradient_checkpointing=True)
    args.update(case.get("args", {}))
    if config_cls is GRPOAccelConfig:
        args.update(SAVERS_ON)
    trainer = trainer_cls(model=model, reward_funcs=rewards, args=config_cls(**args), train_dataset=train,
                          processing_class=tokenizer, **extra)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if n in before}
    return trainer, trainer.state.log_history, update


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_steps_as_trl(name, tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")  # offload's real copy path on CPU
    case = CASES[name]
    if case.get("tools"):
        monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", scripted_tool_turn)
    _, trl_log, trl_update = run(GRPOTrainer, GRPOConfig, case, str(tmp_path / "trl"), tiny_dir)
    ours, our_log, our_update = run(GRPOAccelTrainer, GRPOAccelConfig, case, str(tmp_path / "ours"), tiny_dir)
    assert ours.offload_enabled and ours.padding_free and ours.logprob_impl == "chunked"
    # each prompt ran once per group in these passes
    assert our_log[0]["share_prompt/token_ratio"] < 1, our_log[0].get("share_prompt/token_ratio")
    if case.get("tools"):  # the tool loop ran: calls were made, their responses sit inside completions
        assert trl_log[0]["tools/call_frequency"] > 0
    assert len(our_log) == len(trl_log)
    for trl_row, our_row in zip(trl_log, our_log):
        for key, value in trl_row.items():
            if key not in NOT_COMPARED:
                assert key in our_row and close(value, our_row[key]), (key, value, our_row.get(key))
    assert trl_update.keys() == our_update.keys() and trl_update
    diff = sum(float((our_update[n] - trl_update[n]).double().pow(2).sum()) for n in trl_update) ** 0.5
    norm = sum(float(trl_update[n].double().pow(2).sum()) for n in trl_update) ** 0.5
    assert norm > 0, "no parameter moved: the case shows nothing"
    assert diff <= 1e-5 * norm, (diff, norm)


def test_every_grpo_config_field_is_named():
    """Each field GRPOConfig adds to TrainingArguments is compared by a case, refused with one line, or not affected
    by our savers (with why). A field a TRL upgrade adds fails here until it is placed."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - base
    assert own - trl_compat.FIELDS.keys() == set(), "GRPOConfig fields the matrix does not name"
    assert trl_compat.FIELDS.keys() - own == set(), "names in the matrix that GRPOConfig no longer has"
    for field, (status, why) in {**trl_compat.FIELDS, **trl_compat.TRAINER_ARGUMENTS}.items():
        assert status in trl_compat.STATUSES and why, field
        if status == "compared":  # the text before ';' is the case ids, each one a case of CASES
            cases = why.split(";")[0].split()
            assert cases and set(cases) <= CASES.keys(), (field, set(cases) - CASES.keys())
    named = {c for status, why in [*trl_compat.FIELDS.values(), *trl_compat.TRAINER_ARGUMENTS.values()]
             if status == "compared" for c in why.split(";")[0].split()}
    assert CASES.keys() <= named, f"cases no field names: {CASES.keys() - named}"


def test_docs_table_is_the_matrix():
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "trl-compatibility.md"
    assert trl_compat.markdown_table() in page.read_text(), "regenerate: python -m grpo_accel.trainer.trl_compat"


def test_readme_script_runs(tmp_path, tiny_dir, monkeypatch):
    """README's "From your TRL script" block as written, with only what needs the hub swapped for local stand-ins
    (TRL's quick-start model and dataset) and one short step."""
    import re
    from pathlib import Path

    import datasets

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## From your TRL script"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "from grpo_accel import GRPOAccelConfig, GRPOAccelTrainer" in code
    local = datasets.Dataset.from_list([{"prompt": f"Write about {w}."} for w in "abcdefgh"])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: local)
    code = re.sub(r'model="[^"]+"', f"model={tiny_dir!r}", code)
    code = re.sub(r'GRPOAccelConfig\(output_dir="[^"]+"', f'GRPOAccelConfig(output_dir={str(tmp_path)!r}, max_steps=1, '
                  'max_completion_length=8, per_device_train_batch_size=4, num_generations=4, report_to="none", '
                  'use_cpu=True', code)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["trainer"].state.global_step == 1


def test_a_trainer_made_without_init_runs_trls_code(monkeypatch):
    """TRL's own tests build trainers with __new__ and set only what a method needs: our overrides then run TRL's."""
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts: ("generated", prompts))
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", lambda self, *a, **k: "trl logps")
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: "trl train")
    trainer = object.__new__(GRPOAccelTrainer)
    assert trainer._generate(["p"]) == ("generated", ["p"])
    assert trainer._get_per_token_logps_and_entropies(None, None, None, 1) == "trl logps"
    assert trainer.train() == "trl train"


@pytest.mark.parametrize("funcs", [None, []], ids=["none", "empty"])
def test_reward_funcs_left_out_behaves_as_trl(tmp_path, funcs):
    """Without environments TRL decides what no reward function means; ours says the same."""
    tokenizer = load_tokenizer("tiny-llama")
    outcomes = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (GRPOAccelTrainer, GRPOAccelConfig)):
        args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          report_to="none", bf16=False, use_cpu=True)
        try:
            trainer_cls(model=build_tiny_model("tiny-llama", tokenizer), reward_funcs=funcs, args=args,
                        processing_class=tokenizer, train_dataset=arithmetic_dataset("train", 4))
            outcomes.append("built")
        except Exception as exc:  # noqa: BLE001 - the comparison is the point
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1]


def test_trls_positional_arguments_keep_their_meaning(tmp_path):
    """GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class) by position."""
    tokenizer = load_tokenizer("tiny-llama")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                           report_to="none", bf16=False, use_cpu=True)
    train, held_out = arithmetic_dataset("train", 4), arithmetic_dataset("test", 2)
    trainer = GRPOAccelTrainer(build_tiny_model("tiny-llama", tokenizer), length_reward, args, train, held_out,
                               tokenizer)
    assert trainer.train_dataset is train and trainer.eval_dataset is held_out
    assert trainer.processing_class is tokenizer and trainer.vllm_engine is None


def test_a_trl_config_is_taken_as_it_is(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, epsilon=0.3,
                      loss_type="grpo", report_to="none", bf16=False, use_cpu=True)
    tokenizer = load_tokenizer("tiny-llama")
    trainer = GRPOAccelTrainer(model=build_tiny_model("tiny-llama", tokenizer), reward_funcs=length_reward, args=args,
                               processing_class=tokenizer, train_dataset=arithmetic_dataset("train", 4))
    assert isinstance(trainer.args, GRPOAccelConfig)
    for f in dataclasses.fields(GRPOConfig):
        assert getattr(trainer.args, f.name) == getattr(args, f.name), f.name
