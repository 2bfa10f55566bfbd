"""UserError: the one base class for errors a user can fix (bad flag, missing file, a preset that cannot fit).

`launch/train.py` and `grpo-accel` print a UserError as one `error: ...` line naming the fix and exit 2; every
other exception is our bug (or a library's) and keeps its traceback. Subclasses also derive from the builtin
they used to be (ValueError, RuntimeError) so callers that caught those keep working.
"""

from __future__ import annotations

import errno
import sys


class UserError(Exception):
    """Something the user can fix; the message names the fix."""


class ConfigError(UserError, ValueError):
    """A flag or `--config` value that cannot work; the message names our flag and the fix."""


def run_guarded(fn, *args, speaks: bool = True, after_progress: bool = False) -> int:
    """`fn(*args)`'s exit code; an error the user can fix becomes one `error:` line on stderr and exit code 2: a
    UserError, a full disk, a missing or unreadable path. Anything else is a bug and keeps its traceback.
    `speaks`: whether this process says the line (one a machine: every rank meets the same error, its first says it);
    `after_progress`: start on a new line (a progress bar may be mid-line). The one handler of `launch/train.py`
    and `grpo-accel`."""
    try:
        return fn(*args)
    except UserError as exc:
        line = str(exc)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            line = (f"disk full while writing {exc.filename or 'the run'}. Fix: free space or pass another "
                    f"--output_dir; files are written via rename, so the previous checkpoint and artifacts are "
                    f"intact, and --resume_from_checkpoint latest skips the interrupted save.")
        elif isinstance(exc, (FileNotFoundError, PermissionError)) and exc.filename:
            line = f"{exc.strerror}: {exc.filename}. Fix: check that path."
        else:
            raise
    if speaks:
        print(f"{chr(10) if after_progress else ''}error: {line}", file=sys.stderr, flush=True)
    return 2
