"""Your own data and rewards through launch/train.py (issue 38), each run checked against the same run through TRL's
own GRPOTrainer: the resolved config of our run (resolved_config.json) becomes a GRPOConfig, the same tiny model,
LoRA, rows and rewards go to TRL's trainer, and every step's logged rewards and loss must agree (1e-5 relative).
The dataset TRL gets is read with `datasets.load_dataset` from the same files, so a row or column our loader loses,
reorders or changes shows as different rewards. Runs call launch/train.py's `main` in this process (no 20 s of
imports per run); each covers several cases to keep the tier short.

    OMP_NUM_THREADS=1 pytest tests/test_own_data.py
"""

import csv
import dataclasses
import json
import math

import datasets
import pytest
import torch
from support.launch import TINY_ARGS, assert_user_error, train
from support.rewards import code_reward, math_reward, never_applies, scaled_length
from trl import GRPOConfig, GRPOTrainer

from grpo_accel.data.models import build_tiny_model, load_tokenizer

SYSTEM = "Answer in one word."
# Timings and what only our trainer logs (phase memory, share_prompt) are not compared.
NOT_COMPARED = ("step_time", "memory/", "share_prompt/", "learning_signal/")


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Name thing number {i}."}]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def tiny_reward_model_dir(tmp_path, tokenizer, architecture="ForSequenceClassification") -> str:
    """tiny-llama's shape as a one-logit sequence classifier (or a causal LM: not a reward model), saved."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from grpo_accel.planning.architectures import TINY_CONFIGS

    spec = dict(TINY_CONFIGS["tiny-llama"])
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer), num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id, **spec)
    torch.manual_seed(7)
    cls = AutoModelForSequenceClassification if architecture == "ForSequenceClassification" else AutoModelForCausalLM
    path = tmp_path / f"rm_{architecture}"
    cls.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def launch(args, out, capsys) -> list[dict]:
    """launch/train.py with TINY_ARGS (2 steps unless `args` say otherwise) and `args`: (metrics.csv rows, output)."""
    torch.manual_seed(0)  # LoRA's A matrices draw from the global generator (before TRL seeds): same start as TRL's
    code, stdout, err = train([*TINY_ARGS, "--output_dir", str(out), *args], capsys)
    assert code == 0, err[-3000:]
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, stdout + err


def trl_steps(out, rewards, train_ds, reward_processing_classes=None) -> list[dict]:
    """The run `out` resolved, through TRL's own GRPOTrainer: its GRPOConfig fields, the tiny model, the LoRA."""
    from peft import LoraConfig

    resolved = json.loads((out / "resolved_config.json").read_text())
    names = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    # generation_batch_size is derived from steps_per_generation (TRL refuses both)
    config = {k: v for k, v in resolved["config"].items()
              if k in names and not k.endswith("_token") and k != "generation_batch_size"}
    config.update(output_dir=str(out) + "_trl", report_to="none", save_strategy="no")
    script = resolved["script"]
    lora = LoraConfig(r=script["lora_r"], lora_alpha=script["lora_alpha"], lora_dropout=0.0,
                      target_modules=script["lora_target_modules"], task_type="CAUSAL_LM")
    tokenizer = load_tokenizer("tiny-llama")
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=build_tiny_model("tiny-llama", tokenizer), reward_funcs=rewards,
                          args=GRPOConfig(**config), train_dataset=train_ds, processing_class=tokenizer,
                          reward_processing_classes=reward_processing_classes, peft_config=lora)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]


def assert_same_steps(ours: list[dict], trl: list[dict], steps: int = 2) -> None:
    assert len(ours) == len(trl) == steps
    for our_row, trl_row in zip(ours, trl):
        compared = [k for k in trl_row if not k.startswith(NOT_COMPARED)]
        assert {"loss", "reward"} <= set(compared)
        for key in compared:
            theirs, mine = (float("nan") if v in (None, "") else float(v) for v in (trl_row[key], our_row[key]))
            same = (math.isnan(theirs) and math.isnan(mine)) or math.isclose(theirs, mine, rel_tol=1e-5, abs_tol=1e-7)
            assert same, (our_row["step"], key, mine, theirs)


def test_chat_prompts_with_columns_multi_task_and_held_out_split(tmp_path, capsys):
    """A conversational dataset in a directory (train.jsonl + test.jsonl) with extra columns (`task`, `scale`),
    a system prompt from the flag, two rewards that each apply to half the rows (None elsewhere) and one that
    applies to none (issue 38: strict checks stopped such a run), held-out evaluation by reward."""
    data = tmp_path / "tasks"
    data.mkdir()
    # the tasks in runs of three: with 2 prompts a batch, some batches hold one kind only (asserted below)
    rows = [{"prompt": chat(i), "task": "math" if (i // 3) % 2 else "code", "scale": 1 + i % 4} for i in range(16)]
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "test.jsonl", rows[:3])
    out = tmp_path / "run"
    # 3 steps: never_applies is None for 3 batches in a row, where the old strict check stopped the run
    ours, logged = launch(["--dataset", str(data), "--system_prompt", SYSTEM, "--train_size", "16", "--max_steps", "3",
                           "--rewards", "support.rewards:math_reward,support.rewards:code_reward,"
                           "support.rewards:never_applies"], out, capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["rows_scored"] == 3 and math.isfinite(summary["after"]["reward_mean"])
    assert "held-out reward before: mean" in logged
    held_out = json.loads((out / "heldout_after.json").read_text())
    assert held_out[0]["prompt"][0] == {"role": "system", "content": SYSTEM}

    train_ds = datasets.load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    train_ds = train_ds.map(lambda r: {"prompt": [{"role": "system", "content": SYSTEM}, *r["prompt"]]})
    trl = trl_steps(out, [math_reward, code_reward, never_applies], train_ds)
    assert_same_steps(ours, trl, steps=3)
    # TRL logs None for a reward's mean over a batch it scored no row of
    one_kind = [r for r in trl if None in (r["rewards/math_reward/mean"], r["rewards/code_reward/mean"])]
    assert one_kind, "no batch held one kind only: the case would not show None for a whole batch"


def test_text_prompts_reward_model_and_weights(tmp_path, capsys):
    """A standard (plain-text) dataset in Parquet files (a directory: train + test), a reward model directory beside
    a function that reads a column, --reward_weights; the held-out prompts scored by both, weighted."""
    tokenizer = load_tokenizer("tiny-llama")
    reward_model = tiny_reward_model_dir(tmp_path, tokenizer)
    data = tmp_path / "text"
    data.mkdir()
    rows = [{"prompt": f"Write about thing {i}.", "scale": 1 + i % 3} for i in range(16)]
    datasets.Dataset.from_list(rows).to_parquet(str(data / "train.parquet"))
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(data / "test.parquet"))
    out = tmp_path / "run"
    ours, logged = launch(["--dataset", str(data), "--train_size", "16",
                           "--rewards", f"{reward_model},support.rewards:scaled_length",
                           "--reward_weights", "0.5", "2.0"], out, capsys)
    held_out = json.loads((out / "heldout_before.json").read_text())
    assert [r["prompt"] for r in held_out] == [r["prompt"] for r in rows[:2]]
    assert json.loads((out / "summary.json").read_text())["before"]["rows_scored"] == 2
    # each held-out reward, recomputed here: 0.5 x the reward model's logit on prompt + completion + 2.0 x the function
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    for record, row in zip(held_out, rows):
        with torch.no_grad():
            score = model(**tokenizer(record["prompt"] + record["completion"], return_tensors="pt",
                                      add_special_tokens=False)).logits[0, 0].item()
        expected = 0.5 * score + 2.0 * scaled_length(None, [record["completion"]], [row["scale"]])[0]
        assert record["reward"] == pytest.approx(expected, rel=1e-5)
    train_ds = datasets.load_dataset("parquet", data_files=str(data / "train.parquet"), split="train")
    trl = trl_steps(out, [reward_model, scaled_length], train_ds)  # TRL loads the reward model by its path
    assert any(k.startswith("rewards/rm_ForSequenceClassification") for k in trl[0])
    assert_same_steps(ours, trl)


def test_bad_data_and_rewards_fail_before_loading(tmp_path, capsys):
    """One `error:` line naming the fix, exit 2, nothing written (before any weights load)."""
    tokenizer = load_tokenizer("tiny-llama")
    no_prompt = tmp_path / "d.jsonl"
    write_jsonl(no_prompt, [{"problem": "1+1", "solution": "2"}])
    causal_lm = tiny_reward_model_dir(tmp_path, tokenizer, architecture="ForCausalLM")
    out = tmp_path / "run"
    for args, pattern in [
        (["--dataset", str(no_prompt)], r"row 1 has no 'prompt' column, nor 'question' and 'answer' \(it has "
                                        r"\['problem', 'solution'\]\)\. Fix: a 'prompt' column"),
        (["--rewards", f"length_free,{causal_lm}"], r"neither built in"),
        (["--rewards", f"format,{causal_lm}"], r"is a LlamaForCausalLM, not a sequence classifier\. Fix"),
        (["--rewards", "format,correctness", "--reward_weights", "1.0"],
         r"--reward_weights has 1 weights for 2 rewards \(format, correctness\)\. Fix: one weight per --rewards"),
        (["--dataset", str(no_prompt).replace(".jsonl", ".parquet")], r"does not exist\. Fix"),
    ]:
        assert_user_error([*args, "--output_dir", str(out)], pattern, capsys, out)


def test_file_formats_and_splits(tmp_path):
    """JSONL, JSON, Parquet and CSV give the same rows; a directory's test split is the held-out set; a prompt
    dataset without one gets none (said); question/answer rows keep their seeded held-out share."""
    from grpo_accel.data.datasets import DatasetError, load_run_data

    rows = [{"prompt": f"Say {i}.", "n": i} for i in range(6)]
    ds = datasets.Dataset.from_list(rows)
    write_jsonl(tmp_path / "d.jsonl", rows)
    ds.to_json(str(tmp_path / "d.json"), lines=False)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    for ext in ("jsonl", "json", "parquet", "csv"):
        data = load_run_data(str(tmp_path / f"d.{ext}"), 10, 4)
        assert list(data.train) == rows and data.held_out is None and data.kind == "prompt", ext
        assert "no held-out evaluation" in data.note
    qa = tmp_path / "qa.jsonl"
    write_jsonl(qa, [{"question": f"{i} + 1?", "answer": f"so #### {i + 1}", "level": i} for i in range(6)])
    data = load_run_data(str(qa), 10, 2)
    assert data.kind == "qa" and len(data.train) == 4 and len(data.held_out) == 2
    assert data.train[0]["prompt"][0]["role"] == "system" and "level" in data.train.column_names
    assert not set(data.train["question"]) & set(data.held_out["question"])
    sparse = tmp_path / "sparse.jsonl"  # a column the first row lacks is kept (None there), as TRL users get it
    write_jsonl(sparse, [{"prompt": "a", "task": "poem"}, {"prompt": "b", "task": "code", "tests": "assert 1"}])
    assert list(load_run_data(str(sparse), 10, 0).train)[0] == {"prompt": "a", "task": "poem", "tests": None}
    with pytest.raises(DatasetError, match="has no split 'dev'.*--dataset_split"):
        load_run_data(str(tmp_path / "d.jsonl"), 10, 0, split="dev")
    with pytest.raises(DatasetError, match="some prompts are text and some are chat messages"):
        write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": chat(1)}])
        load_run_data(str(tmp_path / "mixed.jsonl"), 10, 0)


def test_hub_name_with_config_and_split(monkeypatch):
    """A hub name goes to datasets.load_dataset with --dataset_config; without one, a set whose configurations
    include 'main' (GSM8K) still loads as before; the held-out rows come from its test split."""
    from grpo_accel.data.datasets import load_run_data

    calls = []

    def fake_load(name, config=None):
        calls.append((name, config))
        if config is None:
            raise ValueError("Config name is missing.\nPlease pick one among the available configs: ['main', "
                             "'socratic']")
        rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(4)]
        return {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    data = load_run_data("openai/gsm8k", 10, 5)
    assert calls == [("openai/gsm8k", None), ("openai/gsm8k", "main")]
    assert data.kind == "qa" and len(data.train) == 4 and data.held_out["answer"] == ["1"]
    load_run_data("openai/gsm8k", 10, 0, config="socratic", split="test")
    assert calls[-1] == ("openai/gsm8k", "socratic")


def test_planner_counts_a_reward_model(tmp_path):
    """The plan of a run with a reward model holds its weights and its forward over a generation batch."""
    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.planning.memory import reward_model_bytes

    reward_model = tiny_reward_model_dir(tmp_path, load_tokenizer("tiny-llama"))
    base = ["--model", "tiny-llama", "--output_dir", str(tmp_path / "run")]
    without = resolve_run_spec(base).plan()
    spec = resolve_run_spec([*base, "--rewards", f"format,{reward_model}"])
    plan = spec.plan()
    assert without.device["reward_models"] == 0 < plan.device["reward_models"]
    shape, rows = plan.inputs["reward_models"][0]
    # the weights part is the classifier's own parameter count (fp32 here)
    from transformers import AutoModelForSequenceClassification

    n_params = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(reward_model).parameters())
    assert reward_model_bytes(shape, 0, 1, 4) == n_params * 4
    assert rows == spec.config.per_device_train_batch_size * spec.config.steps_per_generation
    assert plan.device["reward_models"] == reward_model_bytes(shape, rows, plan.inputs["max_prompt_length"]
                                                              + plan.inputs["max_completion_length"], 4)


class LiveBytes:
    """Peak bytes of live tensors made by torch ops (a TorchDispatchMode sees each op's outputs; a weakref finalizer
    counts a storage free): what an allocator would have to hold, without the CPU malloc's reuse and RSS noise."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        tracker.add(t)
                return out

        self.mode, self.live, self.peak, self.seen = Mode(), 0, 0, set()

    def add(self, t) -> None:
        import weakref

        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if key and key not in self.seen:
            self.seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self.free, key, n)

    def free(self, key, n) -> None:
        self.seen.discard(key)
        self.live -= n


@pytest.mark.parametrize("intermediate, kv_heads, layers, T", [(1024, 2, 4, 512), (64, 2, 4, 512), (64, 4, 2, 1024)])
def test_reward_model_forward_term_matches_live_bytes(intermediate, kv_heads, layers, T):
    """The planner's forward term against the live tensor bytes of a real classifier's no-grad forward over 4
    right-padded rows (as TRL scores them), loaded as the run loads it (use_cache off), fp32 on CPU: the MLP's peak
    (I=1024) and the attention's (I=64), with 2 and 4 kv heads."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.memory import reward_model_bytes

    rows = 4
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, intermediate_size=intermediate,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                                  num_labels=1, pad_token_id=0, attn_implementation="sdpa", use_cache=False)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids, mask = torch.randint(1, 512, (rows, T)), torch.ones(rows, T, dtype=torch.long)
    mask[1::2, T // 2:] = 0
    tracker = LiveBytes()
    with torch.inference_mode(), tracker.mode:
        model(input_ids=ids, attention_mask=mask)
    shape = model_shape(config)
    predicted = reward_model_bytes(shape, rows, T, 4) - reward_model_bytes(shape, 0, T, 4)
    assert predicted == pytest.approx(tracker.peak, rel=0.02), (predicted / 2**20, tracker.peak / 2**20)
