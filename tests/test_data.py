import json
import os

import pytest

from grpo_accel.data.datasets import (
    LEVELS,
    DatasetError,
    _problems,
    arithmetic_rows,
    load_dataset_by_name,
    prompt_lengths,
    train_eval_datasets,
)

# The real GSM8K files live beside the checkout (../shared), on developer machines and in CI.
GSM8K = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "gsm8k")


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_splits_are_disjoint_and_answers_verify(level):
    train, test = set(_problems(level, "train")), set(_problems(level, "test"))
    assert train and test and not (train & test)
    for row in arithmetic_rows("test", 50, level=level):
        assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"] == row["question"]
        assert int(row["answer"]) == int(row["answer"])


def test_level1_held_out_pairs_never_in_training_rows():
    train_q = {r["question"] for r in arithmetic_rows("train", 2000, level=1)}
    test_q = {r["question"] for r in arithmetic_rows("test", 200, level=1)}
    assert len(test_q) == 200 and not (train_q & test_q)
    q = arithmetic_rows("test", 1, level=1)[0]["question"]
    a, op, b = q.removeprefix("What is ").removesuffix("?").split()
    assert str(eval(f"{a}{op}{b}")) == arithmetic_rows("test", 1, level=1)[0]["answer"]


def test_deterministic_and_seeded():
    assert arithmetic_rows("train", 30, seed=1) == arithmetic_rows("train", 30, seed=1)
    assert arithmetic_rows("train", 30, seed=1) != arithmetic_rows("train", 30, seed=2)


@pytest.mark.skipif(not os.path.isdir(GSM8K), reason="../shared/data/gsm8k is not beside this checkout")
def test_gsm8k_jsonl():
    train, test = train_eval_datasets(GSM8K, 20, 10)
    assert len(train) == 20 and len(test) == 10
    assert test[0]["answer"].lstrip("-").isdigit()
    assert "####" not in test[0]["answer"]


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="does not exist.*Fix"):
        load_dataset_by_name(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="does not exist.*Fix"):
        load_dataset_by_name("../no_such_dir/gsm8k")


def test_missing_fields_and_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    with pytest.raises(DatasetError, match="row 1 has no 'prompt' column, nor 'question' and 'answer'"):
        load_dataset_by_name(str(path))
    path.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: not valid JSON"):
        load_dataset_by_name(str(path))


def test_prompt_lengths_count_chat_tokens():
    """Tokens as the trainer feeds them (transformers 5 returns a BatchEncoding by default: its len is 2)."""
    from grpo_accel.data.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    short = [{"role": "user", "content": "What is 2 + 3?"}]
    long = [{"role": "user", "content": "What is 2 + 3? " * 20}]
    n_short, n_long, n_text = prompt_lengths(tok, [short, long, "plain text prompt"])
    assert n_short == len(tok.apply_chat_template(short, add_generation_prompt=True, return_dict=False)) > 10
    assert n_long > n_short + 100
    assert n_text == len(tok("plain text prompt")["input_ids"])
