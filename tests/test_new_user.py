"""What a new user hits first (issue 13): each case ends in one `error:` line naming our flag and the fix, exit
code 2 and nothing written, or in the run the user meant. Most cases call launch/train.py's `main` in this
process (the same code path, without 10 s of imports per case); the accelerate case launches for real.

    OMP_NUM_THREADS=1 pytest tests/test_new_user.py
"""

import json
import os
import re

import pytest
from support.launch import ROOT, TINY_ARGS, assert_user_error, error_line, run_train, train, train_script


# 1. hub ids with dots reach the hub; a file is not "missing"
def test_hub_id_with_a_dot_asks_the_hub():
    from grpo_accel.core.errors import UserError
    from grpo_accel.data.models import resolve_model_path

    for name in ("Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"):
        with pytest.raises(UserError, match="could not be loaded from the hub"):  # HF_HUB_OFFLINE=1 here
            resolve_model_path(name)
    with pytest.raises(UserError, match="is a file; --model takes a directory"):
        resolve_model_path(os.path.join(ROOT, "pyproject.toml"))
    with pytest.raises(UserError, match="does not exist"):
        resolve_model_path("./no/such/model")


# 2 and 4: numbers validated by our flag's name before anything loads
@pytest.mark.parametrize("flag, value, pattern", [
    ("--lora_r", "-4", r"--lora_r -4 must be ≥ 0.*Fix"),
    ("--max_completion_length", "0", r"--max_completion_length 0 must be ≥ 1.*Fix"),
    ("--per_device_train_batch_size", "0", r"--per_device_train_batch_size 0 must be ≥ 1"),
    ("--num_generations", "3", r"--num_generations 3 must divide the 8 completions.*Fix: --num_generations"),
    ("--num_generations", "1", r"--num_generations 1 must be ≥ 2"),
    ("--temperature", "0", r"--temperature 0.0 must be > 0"),
    ("--model_dtype", "int8", r"--model_dtype int8 is not a dtype.*bf16"),
    ("--lerning_rate", "1e-4", r"unknown flag --lerning_rate; did you mean --learning_rate\?"),
])
def test_bad_flag_is_one_line_naming_the_flag(flag, value, pattern, tmp_path, capsys):
    out = tmp_path / "run"
    assert_user_error([*TINY_ARGS, "--output_dir", str(out), flag, value], pattern, capsys, out)


@pytest.mark.parametrize("reward, pattern", [
    ("support.rewards:broken_reward", r"'broken_reward' raised KeyError"),
    ("support.rewards:none_reward", r"got no reward from any of \['none_reward'\].*--reward_checks trl"),
    ("support.rewards:wrong_count_reward", r"returned 1 rewards for 8 completions"),
    ("support.rewards:nan_reward", r"returned non-finite rewards"),
    ("support.rewards:NOT_CALLABLE", r"is a int, not a function"),
])
def test_bad_reward_leaves_nothing_behind(reward, pattern, tmp_path, capsys):
    out = tmp_path / "run"
    assert_user_error([*TINY_ARGS, "--eval_size", "0", "--output_dir", str(out), "--rewards", reward], pattern,
                      capsys, out)


def test_bf16_spelling_is_accepted(tmp_path):
    from grpo_accel.app.run_spec import resolve_run_spec

    assert resolve_run_spec(["--model_dtype", "bf16", "--output_dir", str(tmp_path)]).script.model_dtype == "bfloat16"


def test_no_learning_signal_is_said_once_then_every_n_steps():
    from types import SimpleNamespace

    from grpo_accel.trainer.callbacks.learning_signal import LearningSignalWatch

    watch = LearningSignalWatch(max_completion_length=12, every_steps=3)
    for step in range(1, 8):
        logs = {"loss": 0.0, "completions/clipped_ratio": 1.0, "frac_reward_zero_std": 0.5 if step < 6 else 1.0}
        watch.on_log(None, SimpleNamespace(global_step=step), None, logs=logs)
    clipped = [w for w in watch.warnings if "--max_completion_length 12" in w]
    assert [int(re.search(r"step (\d+)", w).group(1)) for w in clipped] == [1, 3, 6]
    equal = [w for w in watch.warnings if "equal rewards" in w]
    assert len(equal) == 1 and "step 6" in equal[0] and "reward function" in equal[0]
    watch.on_log(None, SimpleNamespace(global_step=8), None, logs={"loss": 0.1, "completions/clipped_ratio": 0.5})
    assert watch.streaks["clipped"] == 0


# 3. run directories: --config keys behave as flags; an existing run is refused; overwrite replaces it
def test_config_yaml_run_name_and_model_choose_the_directory(tmp_path, monkeypatch):
    from grpo_accel.app.run_spec import resolve_run_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("run_name: my_exp\nmodel: tiny-qwen2\npreset: cpu\nmax_steps: 3\n")
    spec = resolve_run_spec(["--config", "run.yaml"])
    assert spec.config.output_dir == os.path.join("runs", "my_exp") and spec.script.model == "tiny-qwen2"
    assert spec.config.max_steps == 3 and spec.preset.name == "cpu" and "--config" in spec.preset_why
    (tmp_path / "model.yaml").write_text("model: tiny-qwen2\n")
    by_model = resolve_run_spec(["--config", "model.yaml"]).config.output_dir
    assert by_model == os.path.join("runs", "tiny-qwen2-arithmetic")
    assert resolve_run_spec(["--config", "run.yaml", "--run_name", "flag_wins"]).config.run_name == "flag_wins"


def test_bad_config_yaml_names_the_file_and_key(tmp_path, capsys):
    out = tmp_path / "run"
    (tmp_path / "typed.yaml").write_text("max_steps: many\n")
    assert_user_error([*TINY_ARGS, "--output_dir", str(out), "--config", str(tmp_path / "typed.yaml")],
                      r"typed\.yaml: max_steps: 'many' is not a valid int", capsys, out)
    (tmp_path / "typo.yaml").write_text("lerning_rate: 1e-4\n")
    assert_user_error([*TINY_ARGS, "--output_dir", str(out), "--config", str(tmp_path / "typo.yaml")],
                      r"unknown key lerning_rate in --config .*typo\.yaml; did you mean learning_rate\?", capsys, out)


def test_help_lists_config(capsys):
    assert train_script.main(["--help"]) == 0 and "--config CONFIG" in capsys.readouterr().out


def test_existing_run_is_refused_then_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TINY_ARGS, "--eval_size", "0", "--max_steps", "1", "--save_steps", "1", "--output_dir", str(out)]
    code, _, err = train(args, capsys)
    assert code == 0, err[-2000:]
    assert (out / "checkpoint-1").is_dir()
    code, _, err = train(args, capsys)
    assert code == 2 and re.search(r"already holds a run.*--resume_from_checkpoint latest.*--run_name.*"
                                   r"--overwrite_output_dir", error_line(err))
    (out / "checkpoint-3").mkdir()  # an old run's later checkpoint must not survive an overwrite
    code, out_text, err = train([*args, "--overwrite_output_dir", "true"], capsys)
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert "removed the earlier run" in out_text
    card = (out / "README.md").read_text()
    assert "[None]" not in card and "tiny-llama (random weights" in card
    assert "no learning signal" in out_text  # a random tiny model's completions are all clipped at 12 tokens


# 6. smaller
def test_utf8_bom_jsonl_is_read(tmp_path):
    from grpo_accel.data.datasets import read_jsonl

    path = tmp_path / "notepad.jsonl"
    path.write_bytes('{"question": "1+1?", "answer": "2"}\n'.encode("utf-8-sig"))
    assert read_jsonl(str(path)) == [{"question": "1+1?", "answer": "2"}]


def test_report_steps_are_integers_and_coinciding_lines_differ():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_accel.app import report

    fig, ax = plt.subplots()
    ax.plot([1, 2], [0.5, 0.7])
    report.integer_steps(ax)
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    plt.close(fig)
    styles = list(zip(report.SERIES_STYLES, report.SERIES_MARKERS))
    assert len(set(styles)) == len(styles)


# 5. under accelerate launch: one error line; -q keeps accelerate's own traceback away
def test_user_error_under_accelerate_launch(tmp_path):
    import sys

    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
                  os.path.join(ROOT, "accelerate_configs", "cpu.yaml")]
    out = tmp_path / "run"
    result = run_train([*TINY_ARGS, "--output_dir", str(out), "--lora_r", "-4"], launcher=accelerate, timeout=300)
    assert result.returncode != 0
    assert re.search(r"--lora_r -4 must be ≥ 0", error_line(result.stderr))
    assert "Traceback" not in result.stderr and not out.exists()


def test_resolved_config_records_the_preset_and_what_was_given(tmp_path):
    from grpo_accel.app.run_spec import resolve_run_spec

    spec = resolve_run_spec(["--model", "tiny-llama", "--learning_rate", "1e-3", "--output_dir", str(tmp_path)])
    resolved = json.loads(json.dumps(spec.resolved(), default=str))
    assert resolved["preset"] == "cpu" and "learning_rate" in resolved["explicit"]
    assert resolved["config"]["learning_rate"] == 1e-3
