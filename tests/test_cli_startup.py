"""The command line answers in seconds: what `launch/train.py --help`, `grpo-accel presets` and `grpo-accel plan`
import, and that the fast paths print what the slow ones would. The seconds themselves are measured by
benchmarks/bench_cli_startup.py (whole-process time, median of 5), not here: a timed test fails on a busy machine."""

import os
import subprocess
import sys
import warnings
from importlib import metadata

import pytest
from support.launch import ROOT, child_env

from grpo_accel.app import cli, train_help


def imported_modules(args: list[str]) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules a fresh `python -X importtime ARGS` imported (from its import-time report), and the process. No
    WANDB_MODE, as a user planning has none (with it transformers prints an [INFO] line as it imports)."""
    env = {k: v for k, v in child_env().items() if k != "WANDB_MODE"}
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    names = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return names, proc


# The packages whose fields the shipped --help lists (TRL's GRPOConfig, transformers' TrainingArguments: pyproject's
# dependencies), written here and not read from train_help.VERSIONED: a versions line that stopped naming one would
# ship the text unchanged through that package's upgrade, and a check built on VERSIONED would agree with it.
FIELD_PACKAGES = ("trl", "transformers")


def written_for() -> dict[str, str]:
    """What the shipped text's first line names, e.g. {'trl': '1.16.0', 'transformers': '5.24.0', 'python': '3.11'}."""
    first = train_help.HELP_FILE.read_text().split("\n", 1)[0]
    return dict(item.rsplit(" ", 1) for item in first.removeprefix("# ").split(", "))


def shipped_for_this_venv() -> str:
    """The shipped text, where this venv has the versions it names (CI's venv: what pyproject.toml resolves to);
    there `launch/train.py --help` must print it, so None fails. Elsewhere (another TRL, transformers or Python)
    the live parser prints it and the test skips."""
    named = written_for()
    assert set(named) == {*FIELD_PACKAGES, "python"}, f"the shipped --help's versions line names {sorted(named)}"
    here = {**{name: metadata.version(name) for name in FIELD_PACKAGES},
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    if here != named:
        pytest.skip(f"the shipped --help is for {named}, this venv has {here} (CI's venv checks it; "
                    "python -m grpo_accel.app.train_help --write regenerates it)")
    shipped = train_help.shipped_help()
    assert shipped is not None, (f"the shipped --help is for this venv's {named}, yet train_help refuses it (its "
                                 f"versions line here: '{train_help.versions_line()}'): --help would take 13 s")
    return shipped


def test_shipped_help_is_the_live_parsers():
    """The text launch/train.py --help prints without importing TRL is the live parser's, for the installed TRL and
    transformers. Fails after a TRL upgrade or a new flag: `python -m grpo_accel.app.train_help --write`."""
    shipped = shipped_for_this_venv()
    assert shipped == train_help.live_help(), "stale: python -m grpo_accel.app.train_help --write"
    assert "--max_completion_length" in shipped and "--offload_activations" in shipped  # TRL's fields and ours


def test_help_for_other_versions_is_the_live_parsers(tmp_path, monkeypatch, capsys):
    """Written for another TRL, the shipped text is not used: the live parser prints (slow, never stale)."""
    stale = tmp_path / "train_help.txt"
    stale.write_text("# trl 0.0.1, transformers 0.0.1\nusage: stale\n")
    monkeypatch.setattr(train_help, "HELP_FILE", stale)
    assert train_help.shipped_help() is None
    train_help.print_help()
    assert capsys.readouterr().out == train_help.live_help()


def test_train_help_imports_neither_torch_nor_trl():
    shipped = shipped_for_this_venv()  # elsewhere the live parser prints it, importing TRL
    names, proc = imported_modules([os.path.join("launch", "train.py"), "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == shipped
    assert not names & {"torch", "transformers", "trl"}, sorted(names & {"torch", "transformers", "trl"})


def test_presets_import_no_torch():
    names, proc = imported_modules(["-m", "grpo_accel.app.cli", "presets"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "h100_110k" in proc.stdout and "torch" not in names


def test_plan_command_skips_peft_and_prints_the_in_process_plan(capsys):
    """The console command plans without peft, bitsandbytes and transformers' model classes (~8 s of imports,
    grpo_accel/_compat/plan_only.py): it prints exactly what the same plan prints in a process that imported them,
    and no upstream warning."""
    preset = "h100_110k"  # QLoRA: bitsandbytes is named in its checks, yet not imported
    names, proc = imported_modules(["-m", "grpo_accel.app.cli", "plan", "--preset", preset])
    skipped = {"peft", "bitsandbytes", "transformers.modeling_utils", "transformers.integrations.integration_utils"}
    assert "trl" in names and not names & skipped, sorted(names & skipped)
    import peft  # noqa: F401  (this process has it, as launch/train.py's does)

    code = cli.main(["plan", "--preset", preset])
    # transformers prints this as it first imports its integrations where WANDB_MODE=offline (the tests' processes)
    ours = "".join(ln for ln in capsys.readouterr().out.splitlines(True) if "Running in WANDB offline mode" not in ln)
    assert (proc.returncode, proc.stdout) == (code, ours)
    assert "Warning" not in "".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:"))


def test_the_config_filters_only_trls_default_deprecation():
    """GRPOConfig's default gradient_checkpointing=True trips transformers' deprecation in every config: filtered for
    that message and that call only. A deprecated name the user sets themselves still warns, and the process's
    warning filters are as before."""
    from grpo_accel.trainer.config import GRPOAccelConfig

    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOAccelConfig(output_dir="unused", use_cpu=True)
        assert not [w for w in caught if "gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
        GRPOAccelConfig(output_dir="unused", use_cpu=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        assert [w for w in caught if "`gradient_checkpointing_kwargs` is deprecated" in str(w.message)]
    assert warnings.filters == filters


@pytest.mark.parametrize("env", [{}, {"KUBEFLOW_TRAINER_SERVER_URL": "http://trainer:8080"},
                                 {"KUBEFLOW_TRAINER_SERVER_URL": "http://trainer:8080",
                                  "DISABLE_KUBEFLOW_INTEGRATION": "true"},
                                 {"DISABLE_KUBEFLOW_INTEGRATION": "TRUE"}])
def test_plan_only_kubeflow_check_is_transformers_own(env, monkeypatch):
    """The plan answers TrainingArguments' Kubeflow check itself (to skip the model classes' imports): it must say
    what transformers' own check says, or a Kubeflow job's plan would show other `report_to` than its run."""
    from transformers.integrations import integration_utils

    from grpo_accel._compat import plan_only

    for key in ("KUBEFLOW_TRAINER_SERVER_URL", "DISABLE_KUBEFLOW_INTEGRATION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert plan_only.is_kubeflow_available() == integration_utils.is_kubeflow_available()
