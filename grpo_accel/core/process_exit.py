"""Ending a finished process without the interpreter's teardown.

When a run ends, CPython's finalization frees every module and object torch, transformers, TRL, peft and DeepSpeed
loaded, one by one, in C: 2.5-6 s of one core after a 2-step tiny-model run through launch/train.py on the 2-core CI
machine (user time 21.5-25.0 s exiting normally, 18.7-19.0 s exiting here; 2026-11-29). Every rank of every launch
pays it, and the test tiers start a few hundred such processes. The operating system takes the memory back anyway;
what teardown does that matters is done here first, in the order finalization does it:

1. wait for the non-daemon threads (finalization's first step, threading's own: its atexit hooks first, which tell
   a ThreadPoolExecutor's idle workers to stop; joining them before that waits forever),
2. run the atexit handlers (wandb's finish, logging's flush, torch's),
3. flush every file object still open for writing: one left unclosed by a library would otherwise lose its buffer,
   which teardown flushes when it frees the object,
4. flush stdout and stderr, then os._exit(code).

Only for a process that ended normally: an exception that escapes main() still goes through Python's own exit (its
traceback, exit code 1, full teardown).
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading


def exit_without_teardown(code: int | None) -> None:
    """Exit with `code` (None: 0) after everything finalization does that can write anything."""
    # CPython's own two steps of finalization; elsewhere take the normal exit
    join_threads, run_handlers = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_handlers is None:
        sys.exit(code)
    join_threads()
    run_handlers()
    for obj in gc.get_objects():
        # by type: isinstance on an instance asks it for __class__, which some modules' deprecated objects answer
        # with a warning (torch.distributed.reduce_op)
        if issubclass(type(obj), io.IOBase) and obj is not sys.stdout and obj is not sys.stderr:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # a detached wrapper or a broken pipe: nothing of ours to save there
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0 if code is None else code)
