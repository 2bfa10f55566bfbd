"""Run launch/train.py the way a user does, in a subprocess, with the tests' environment."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--model", "tiny-llama", "--train_size", "32", "--eval_size", "4", "--eval_max_new_tokens", "8",
             "--max_completion_length", "12", "--num_generations", "4", "--per_device_train_batch_size", "8",
             "--max_steps", "2", "--save_steps", "100", "--logging_steps", "1"]


def child_env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "tests"))
    env.update(extra)
    return env



def run_train(args, launcher=None, timeout=900, **env):
    """`python launch/train.py ARGS`, or `<launcher...> launch/train.py ARGS` (e.g. accelerate launch)."""
    cmd = [*(launcher or [sys.executable]), os.path.join(ROOT, "launch", "train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def error_line(stderr: str) -> str:
    """The one line a user reads: `error: ...` (progress bars may print after it while closing)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]
