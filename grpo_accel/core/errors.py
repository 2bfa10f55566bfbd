"""UserError: the one base class for errors a user can fix (bad flag, missing file, a preset that cannot fit).

`launch/train.py` and `grpo-accel` print a UserError as one `error: ...` line naming the fix and exit 2; every
other exception is our bug (or a library's) and keeps its traceback. Subclasses also derive from the builtin
they used to be (ValueError, RuntimeError) so callers that caught those keep working.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message names the fix."""


class ConfigError(UserError, ValueError):
    """A flag or `--config` value that cannot work; the message names our flag and the fix."""
