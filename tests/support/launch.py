"""Run launch/train.py the way a user does, in a subprocess, with the tests' environment."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "workers")  # scripts the tests launch (tests/workers/*_worker.py)
TINY_ARGS = ["--model", "tiny-llama", "--train_size", "32", "--eval_size", "4", "--eval_max_new_tokens", "8",
             "--max_completion_length", "12", "--num_generations", "4", "--per_device_train_batch_size", "8",
             "--max_steps", "2", "--save_steps", "100", "--logging_steps", "1"]

# torch DDP over gloo, 2 CPU processes, no DeepSpeed. MULTI_GPU is accelerate's torchrun launcher: a MULTI_CPU config
# starts one process unless mpirun runs it. use_cpu stays false here; the run sets it (run_spec.cpu_processes_defaults).
DDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
mixed_precision: 'no'
num_processes: 2
num_machines: 1
machine_rank: 0
main_process_port: 0
rdzv_backend: static
same_network: true
use_cpu: false
main_training_function: main
enable_cpu_affinity: false
downcast_bf16: 'no'
"""


def child_env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "tests"))
    env.update(extra)
    return env



def run_train(args, launcher=None, timeout=600, **env):
    """`python launch/train.py ARGS`, or `<launcher...> launch/train.py ARGS` (e.g. accelerate launch)."""
    cmd = [*(launcher or [sys.executable]), os.path.join(ROOT, "launch", "train.py"), *args]
    return run_process_group(cmd, timeout, cwd=ROOT, env=child_env(**env))


def free_port() -> int:
    """A port nothing listens on now (a fixed one collides with a run left over from an earlier test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_process_group(cmd, timeout, **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True), but a run past `timeout` fails the test with every
    process's Python stacks (launch/train.py dumps them on SIGUSR1) and takes its whole process group down: a
    launcher killed alone leaves its ranks running, holding CPU and locks that stall the tests after it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen_kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGUSR1)  # ranks print their stacks; the launcher (no handler) exits
        time.sleep(5)
        _signal_group(proc, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... ran past {timeout} s. Its stdout (end):\n{stdout[-3000:]}\n"
                    f"stderr with the stacks (end):\n{stderr[-12000:]}", pytrace=False)
    except BaseException:  # pytest-timeout's alarm, Ctrl-C: never leave the ranks running
        _signal_group(proc, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # every process of the group already gone
        pass


def error_line(stderr: str) -> str:
    """The one line a user reads: `error: ...` (progress bars may print after it while closing)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


def _train_script():
    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "launch", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_script = _train_script()


def train(args, capsys):
    """launch/train.py's `main` in this process (the same code path, without 10-20 s of imports per run):
    (exit code, stdout, stderr)."""
    code = train_script.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(args, pattern, capsys, out_dir):
    """One `error:` line matching `pattern`, exit code 2, no traceback, nothing written."""
    code, _, err = train(args, capsys)
    assert code == 2, err[-2000:]
    assert re.search(pattern, error_line(err)), error_line(err)
    assert "Traceback" not in err
    assert not os.path.exists(out_dir), os.listdir(out_dir)
