"""The bad-input table: each case exits 2 with one `error:` line naming the fix, and writes no run directory."""

import errno
import os
import re

import pytest
from support.launch import TINY_ARGS, error_line, train

from grpo_accel.app.report import atomic_write_text
from grpo_accel.app.runner import main_guarded


def tiny_model_without_chat_template(tmp_path):
    from grpo_accel.data.models import load_model

    model, tokenizer = load_model("tiny-llama")
    tokenizer.chat_template = None
    path = tmp_path / "no_template"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for name in os.listdir(path):  # transformers 5 keeps the template in its own file too
        if name.startswith("chat_template"):
            os.remove(path / name)
    return str(path)


CASES = {
    "malformed_yaml": (lambda d: ["--config", write(d / "bad.yaml", "learning_rate: [1e-4\nmax_steps: 2\n")],
                       r"not valid YAML.*line"),
    "malformed_jsonl": (lambda d: ["--dataset", write(d / "d.jsonl", '{"question": "1+1", "answer": "2"}\n{oops\n')],
                        r"d\.jsonl:2: not valid JSON"),
    "generation_batch": (lambda d: ["--generation_batch_size", "10"],
                         r"generation_batch_size \(10\) must be divisible by the global batch size \(8\)"),
    "lora_targets": (lambda d: ["--lora_target_modules", "q_proj,not_a_module"],
                     r"\['not_a_module'\] are not in tiny-llama.*Fix"),
    "prompt_too_long": (lambda d: ["--max_completion_length", "4000"],
                        r"exceed tiny-llama's context of 2048 tokens.*Fix: lower --max_completion_length"),
    "output_not_writable": (lambda d: ["--output_dir", os.path.join(write(d / "a_file", "x"), "run")],
                            r"not writable.*Fix"),
    "no_chat_template": (lambda d: ["--model", tiny_model_without_chat_template(d)], r"no chat template.*Fix"),
}


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, tmp_path, capsys):
    """launch/train.py's main in this process (support.launch.train: the same code path without ~12 s of imports a
    case; test_new_user.py checks the error path through a real `accelerate launch` process)."""
    make_args, message = CASES[case]
    extra = make_args(tmp_path)
    out = tmp_path / "run"
    args = [*TINY_ARGS, "--output_dir", str(out), *extra] if "--output_dir" not in extra else [*TINY_ARGS, *extra]
    code, _, err = train(args, capsys)
    assert code == 2, err[-3000:]
    assert re.search(message, error_line(err)), error_line(err)
    assert not out.exists()


def test_disk_full_while_saving_is_one_clear_line(tmp_path, capsys, monkeypatch):
    """Simulated ENOSPC: the artifact being written is not left half-written, the message names the fix."""
    target = tmp_path / "summary.json"
    target.write_text('{"previous": true}')
    real_fdopen = os.fdopen

    def full_disk(fd, *a, **kw):
        f = real_fdopen(fd, *a, **kw)
        f.write = lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device", str(target)))
        return f

    monkeypatch.setattr(os, "fdopen", full_disk)
    assert main_guarded(atomic_write_text, str(target), '{"new": true}') == 2
    assert "disk full while writing" in capsys.readouterr().err
    assert target.read_text() == '{"previous": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("rank, local_rank, speaks", [(0, 0, True), (1, 0, True), (1, 1, False)],
                         ids=["rank0", "second_machines_first", "second_process_of_a_machine"])
def test_each_machines_first_process_says_the_error(rank, local_rank, speaks, monkeypatch, capsys):
    """Every rank meets the error; one line a machine (its terminal). A two-machine launch's second machine runs
    RANK 1 at LOCAL_RANK 0: said by rank 0 alone, it exited 2 without a word."""
    from grpo_accel.core.errors import ConfigError

    def fails():
        raise ConfigError("bad flag. Fix: another")

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert main_guarded(fails) == 2
    assert ("error: bad flag. Fix: another" in capsys.readouterr().err) == speaks


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "4bit", "--lora_r", "0"], r"^--quantization 4bit trains LoRA adapters only \(QLoRA\)\. Fix: "),
    (["--fp16", "true", "--bf16", "true", "--use_cpu", "true"],  # use_cpu: else "no bf16 GPU" is said first
     r"At most one of fp16 and bf16 .* Fix: change that flag\.$"),
], ids=["qlora_without_lora", "fp16_and_bf16"])
def test_pairs_that_cannot_run_together_are_refused(tmp_path, argv, message):
    """The two refused pairs of docs/pairs.md that are not SP's (test_sequence_parallel.py has those): QLoRA without
    adapters, and both half precisions. Parsed in-process as launch/train.py parses them (RunParser.build), each
    becomes one ConfigError line naming the fix (main_guarded prints it as `error: ...` and exits 2)."""
    from grpo_accel.app.run_spec import RunParser
    from grpo_accel.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        RunParser().build([*TINY_ARGS, "--output_dir", str(tmp_path / "run"), *argv], {})
    text = str(err.value)
    assert "\n" not in text and re.search(message, text), text
