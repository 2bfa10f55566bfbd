"""Run launch/train.py the way a user does, in a subprocess, with the tests' environment."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
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
    """A launched process's environment: offline, one thread, `support` importable, and grpo_accel from this checkout
    (not the one the venv's editable install names: tests/mutations.py runs the tests in a scratch copy)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]))
    env.update(extra)
    return env



def run_train(args, launcher=None, timeout=600, **env):
    """`python launch/train.py ARGS`, or `<launcher...> launch/train.py ARGS` (e.g. accelerate launch)."""
    cmd = [*(launcher or [sys.executable]), os.path.join(ROOT, "launch", "train.py"), *args]
    return run_process_group(cmd, timeout, cwd=ROOT, env=child_env(**env))


ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
MULTINODE_YAML = os.path.join(ROOT, "accelerate_configs", "multinode_zero3.yaml")
# What a CPU loopback changes in the multinode_zero3 preset's YAML, as flags on the launch command (a user sets the
# address and machine rank the same way). The YAML's other keys are the preset's: its DeepSpeed ZeRO-3 and its
# `standard` multinode launcher (torchrun on each machine); use_cpu stays false, as CPU DeepSpeed needs it
# (cpu_zero3.yaml: with true accelerate drops DeepSpeed), and gpu_ids `all` sets no CUDA_VISIBLE_DEVICES.
LOOPBACK_FLAGS = ["--num_processes", "2",  # in all, one a machine (the preset's 2 x 8 GPUs; 2 cores here)
                  "--main_process_ip", "127.0.0.1",  # machine 0's address as machine 1 reaches it
                  # the preset's bf16 against fp32 training arguments: transformers refuses the DeepSpeed config
                  # ("ds bf16.enabled=True vs hf bf16=False"); fp32, as the cpu_zero* launches compared with
                  "--mixed_precision", "no"]


def run_train_two_machines(args, config_file=MULTINODE_YAML, timeout=600, **env) -> list[subprocess.CompletedProcess]:
    """The multinode_zero3 launch as two machines on loopback: `accelerate launch --config_file <config_file>
    --machine_rank 0` and `... --machine_rank 1`, one process each over gloo, both started at once; their results,
    machine 0's first. Past `timeout` both are killed and the test fails with both outputs (run_process_groups).
    config_file: the shipped preset YAML, or one derived from it. The training side comes from `args`: the preset's
    is an 8B model (--preset cpu_zero3 runs the tiny one; test_preset_steps.py runs the preset's own, scaled down)."""
    port = str(free_port())  # one for both machines: the accelerate YAML's 0 (any free port) is a single machine's
    cmds = [[ACCELERATE, "launch", "--config_file", str(config_file), "--machine_rank", str(machine), *LOOPBACK_FLAGS,
             "--main_process_port", port, os.path.join(ROOT, "launch", "train.py"), *args] for machine in (0, 1)]
    # gloo's interface: launch/train.py pins it to loopback only when every process is on one machine (on two real
    # machines loopback reaches neither); two machines on one host share it.
    return run_process_groups(cmds, timeout, cwd=ROOT, env=child_env(GLOO_SOCKET_IFNAME="lo", **env))


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
    return run_process_groups([cmd], timeout, **popen_kwargs)[0]


def run_process_groups(cmds, timeout, **popen_kwargs) -> list[subprocess.CompletedProcess]:
    """run_process_group for several commands at once (the machines of one launch), each its own process group:
    past `timeout` (one for all) every group gets SIGUSR1 then SIGKILL, and the test fails with each one's output.
    Output goes to files, not pipes: a command nobody reads while waiting on another cannot block on a full pipe."""
    procs, files = [], []
    try:
        for cmd in cmds:
            out, err = (tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") for _ in range(2))
            files.append((out, err))
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, **popen_kwargs))
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                _signal_group(proc, signal.SIGUSR1)  # ranks print their stacks; the launchers (no handler) exit
            time.sleep(5)
            for proc in procs:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            told = "\n".join(f"{' '.join(cmd[:8])} ... (exit {proc.returncode}). Its stdout (end):\n"
                             f"{_read(out)[-3000:]}\nstderr with the stacks (end):\n{_read(err)[-12000:]}"
                             for cmd, proc, (out, err) in zip(cmds, procs, files))
            pytest.fail(f"ran past {timeout} s:\n{told}", pytrace=False)
        return [subprocess.CompletedProcess(cmd, proc.returncode, _read(out), _read(err))
                for cmd, proc, (out, err) in zip(cmds, procs, files)]
    except BaseException:  # pytest-timeout's alarm, Ctrl-C, the failure above: never leave the ranks running
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)
        raise
    finally:
        for out, err in files:
            out.close()
            err.close()


def _read(f) -> str:
    f.seek(0)
    return f.read()


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
