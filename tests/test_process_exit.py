"""core/process_exit.py: a finished process skips the interpreter's teardown and loses nothing teardown would have
written. Each case runs in a fresh interpreter (the function ends its process)."""

import os
import subprocess
import sys

import pytest

CHILD = r"""
import atexit, sys, threading, time
from grpo_accel.core.process_exit import exit_without_teardown

out = sys.argv[1]
held = open(out + ".held", "w", buffering=1 << 20)  # a library's file, open and unflushed at the end
held.write("kept in the buffer\n")
unreferenced = open(out + ".dropped", "w", buffering=1 << 20)
unreferenced.write("only in the buffer\n")
del unreferenced  # (CPython frees it here: the case a reference cycle would delay)

def late_writer():
    time.sleep(0.5)
    with open(out + ".thread", "w") as f:
        f.write("written by a non-daemon thread\n")

threading.Thread(target=late_writer).start()
atexit.register(lambda: open(out + ".atexit", "w").write("handler ran\n"))
print("stdout line", end="")  # no newline: still in stdout's buffer
if sys.argv[2] == "exit":
    exit_without_teardown(3)
import os
os._exit(3)  # the control: the same ending without the flushes
"""


def run_child(tmp_path, how):
    out = tmp_path / how
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as in a pipe
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), how], capture_output=True, text=True, timeout=60,
                          env=env)
    return proc, out


def test_threads_handlers_and_open_files_are_written_before_the_exit_code(tmp_path):
    proc, out = run_child(tmp_path, "exit")
    assert proc.returncode == 3 and proc.stdout == "stdout line", proc.stderr
    assert (tmp_path / "exit.held").read_text() == "kept in the buffer\n"
    assert (tmp_path / "exit.dropped").read_text() == "only in the buffer\n"
    assert (tmp_path / "exit.thread").read_text() == "written by a non-daemon thread\n"
    assert (tmp_path / "exit.atexit").read_text() == "handler ran\n"


def test_the_control_ending_loses_them(tmp_path):
    """What the flushes are for: os._exit alone loses the held file's buffer, the handler, the thread and stdout
    (the unreferenced file is flushed when CPython frees it, before either ending)."""
    proc, out = run_child(tmp_path, "control")
    assert proc.returncode == 3 and proc.stdout == ""
    assert (tmp_path / "control.held").read_text() == ""
    assert not (tmp_path / "control.atexit").exists() and not (tmp_path / "control.thread").exists()


@pytest.mark.parametrize("code", [None, 0, 2])
def test_exit_code(tmp_path, code):
    prog = f"from grpo_accel.core.process_exit import exit_without_teardown; exit_without_teardown({code})"
    assert subprocess.run([sys.executable, "-c", prog], timeout=60).returncode == (code or 0)


def test_an_idle_thread_pool_does_not_hold_the_exit(tmp_path):
    """A ThreadPoolExecutor's workers are non-daemon threads that wait for work until the interpreter's own shutdown
    tells them to stop (threading's atexit hooks, before it joins them): joining them first waits forever (server
    mode's read-ahead pool hung a rank of a 2-process launch this way)."""
    prog = ("from concurrent.futures import ThreadPoolExecutor\n"
            "from grpo_accel.core.process_exit import exit_without_teardown\n"
            "pool = ThreadPoolExecutor(1)\n"
            "pool.submit(print, 'ran').result()\n"
            "exit_without_teardown(4)\n")
    proc = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and proc.stdout == "ran\n", proc.stderr
