"""A reward function's failures made loud and named, never a silent 0 (the trainer wraps each reward callable with
`guarded`): here in trainer/ because it reads a callable as TRL does (its name for rewards/<name>, async or not), and
only the trainer touches TRL (pyproject.toml's import contract)."""

from __future__ import annotations

import functools
import math

from grpo_accel.data.rewards import RELAX_FLAG, RewardFunctionError


def guarded(func, strict: bool = True):
    """Wrap a reward function so its failures are loud and named, never a silent 0; an `async def` one stays async
    (TRL runs those on its event loop, concurrently).

    Always: RewardFunctionError naming the function when it raises or returns the wrong number of rewards (TRL
    raises a bare error, or a ValueError for the count). `strict` (GRPOAccelConfig(reward_checks="strict"), the
    launch/train.py default) adds NaN / inf, which TRL lets through (it reads NaN as "does not apply" and nan-sums it
    away). None stays TRL's "does not apply to this row", even for a whole batch: a row that no reward scored is the
    trainer's check (trainer/callbacks/guards.py `check_reward_rows`): only the rewards together say whether
    a row is blank.
    """
    from trl.trainer.utils import get_callable_name, is_async_callable  # TRL's own reading of a reward callable

    name = get_callable_name(func)  # the name TRL logs it under (rewards/<name>/mean): kept by the wrapper

    def check(rewards, completions):
        if rewards is None or len(rewards) != len(completions):
            got = "None" if rewards is None else len(rewards)
            raise RewardFunctionError(
                f"reward function {name!r} returned {got} rewards for {len(completions)} completions. "
                f"Fix: return one float (or None) per completion."
            )
        bad = [r for r in rewards if r is not None and not math.isfinite(float(r))] if strict else []
        if bad:
            raise RewardFunctionError(
                f"reward function {name!r} returned non-finite rewards {bad[:3]}. Fix: return finite floats, or None "
                f"for rows it does not apply to ({RELAX_FLAG} reads NaN as None, as TRL does)."
            )
        return rewards

    def failed(exc):
        return RewardFunctionError(
            f"reward function {name!r} raised {type(exc).__name__}: {exc}. "
            f"Fix the function (it gets prompts, completions and the dataset's columns as keyword arguments).")

    if is_async_callable(func):
        @functools.wraps(func)
        async def async_wrapper(prompts, completions, **kwargs):
            try:
                rewards = await func(prompts=prompts, completions=completions, **kwargs)
            except Exception as exc:
                raise failed(exc) from exc
            return check(rewards, completions)

        async_wrapper.__name__ = name
        return async_wrapper

    @functools.wraps(func)
    def wrapper(prompts, completions, **kwargs):
        try:
            rewards = func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:
            raise failed(exc) from exc
        return check(rewards, completions)

    wrapper.__name__ = name
    return wrapper
