"""Graceful preemption: on SIGTERM finish the step in flight, save a checkpoint, say how to resume, exit 0.

Clouds and schedulers send SIGTERM, then SIGKILL after a grace period (Kubernetes 30 s, SLURM `--signal`,
torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default). Losing the work since the last `save_steps`
checkpoint is the default; here the handler only sets a flag, and at the end of the step in flight
`Preemption` (a TrainerCallback) asks the Trainer to save and stop. The Trainer writes trainer_state.json
last, so `--resume_from_checkpoint latest` skips a save that a SIGKILL cut short (trainer/checkpoints.py).

Several processes: every rank must stop at the same step, or the ones that go on wait forever in a collective.
The flag crosses the ranks through accelerate's `set_trigger` / `check_trigger` at each step end: one small
all-reduce per optimizer step (~50 µs over NCCL or gloo, against steps of seconds). How the signal reaches the ranks:
- torchrun / `accelerate launch` with several processes: the agent traps SIGTERM, sends it to every rank, waits
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, then SIGKILLs them; the agent itself then exits non-zero (torch's
  SignalException), whatever the ranks did. Set that timeout above one step plus one save.
- `accelerate launch` with one process: the launcher has no handler and dies at once, leaving the trainer
  running unsignalled; `forward_parent_death()` asks the kernel to send SIGTERM when that parent dies.
- schedulers that signal the whole process group reach every rank directly; a second SIGTERM changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from transformers import TrainerCallback

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def forward_parent_death(sig: int = signal.SIGTERM) -> bool:
    """When the parent is a one-process `accelerate launch`, have the kernel send `sig` here when it dies.
    Only then: PR_SET_PDEATHSIG fires when the parent *thread* exits, and torchrun's agent forwards the signal
    itself. Linux only; False where it does not apply."""
    if not sys.platform.startswith("linux") or os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        return False
    if not any(part.endswith(b"accelerate") for part in parent) or b"launch" not in parent:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


class Preemption(TrainerCallback):
    """Turns SIGTERM during train() into save-and-stop at the end of the step in flight."""

    def __init__(self, accelerator, signals=(signal.SIGTERM,)):
        self.accelerator = accelerator  # its set_trigger / check_trigger carry the flag to every rank
        self.signals = signals
        self.received: int | None = None  # the signal number, once one arrived
        self.stopped_at: int | None = None  # the step whose end saved and stopped
        self._previous = {}

    def install(self) -> Preemption:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # Python only delivers signals to the main thread; a trainer built elsewhere goes without
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        forward_parent_death()
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            # os.write, not print: the handler may interrupt a print to stderr (tqdm), and a buffered stream
            # entered twice raises "reentrant call".
            os.write(2, f"\n[grpo_accel] {signal.Signals(signum).name} received: finishing the step in flight, then "
                        f"saving a checkpoint and exiting\n".encode())
        self.received = signum

    # The handler lives only while train() runs: a process that merely built a trainer (a test suite, a notebook)
    # keeps its own SIGTERM behaviour.
    def on_train_begin(self, args, state, control, **kwargs):
        self.install()

    def on_train_end(self, args, state, control, **kwargs):
        self.uninstall()

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is not None:
            return
        if self.received is not None:
            self.accelerator.set_trigger()
        if self.accelerator.check_trigger():  # every rank, every step: the collective must match
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            control.should_log = True  # the steps since the last log (logging_steps > 1) go into the checkpoint too

    def on_save(self, args, state, control, **kwargs):
        if self.stopped_at is not None:  # the scheduler may cut power right after: flush this rank's files
            _fsync_tree(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    @property
    def preempted(self) -> bool:
        return self.stopped_at is not None

    def resume_line(self, output_dir: str) -> str:
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        return (f"preempted ({name}): step {self.stopped_at} finished and saved to "
                f"{os.path.join(output_dir, f'checkpoint-{self.stopped_at}')}. Resume: run the same command with "
                f"--resume_from_checkpoint latest --output_dir {output_dir}")


def _fsync_tree(path: str) -> None:
    """fsync every file under `path`, then the directories (a rename or create is durable once its dir is)."""
    if not os.path.isdir(path):
        return
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
