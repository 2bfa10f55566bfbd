import math
from fractions import Fraction

import pytest

from grpo_accel.data.rewards import (
    RewardFunctionError,
    accuracy,
    correctness_reward,
    extract_answer,
    format_reward,
    has_strict_format,
    parse_number,
    resolve_rewards,
)
from grpo_accel.trainer.reward_guard import guarded


@pytest.mark.parametrize("text,strict,lenient", [
    ("7 + 5 = 12.\nAnswer: 12", 12, 12),
    ("The total is $1,234.50 dollars.", None, Fraction("1234.5")),
    ("So she has 18 apples left.", None, 18),
    ("We get \\boxed{42} as the result, not 41", 42, 42),
    ("\\boxed{ 1,000 }", 1000, 1000),
    ("Natalia sold 72 clips.\n#### 72", 72, 72),
    ("The answer is -7.", -7, -7),
    ("Final answer: **15**", 15, 15),
    ("3 - 10 = -7, so the answer is -7", -7, -7),
    ("Answer: 12 apples", 12, 12),
    ("answer = 3/4", Fraction(3, 4), Fraction(3, 4)),
    ("I computed 12 then 15, Answer: 12. Check: 12 + 3 = 15", 12, 12),  # explicit answer beats last number
    ("no numbers here", None, None),
    ("", None, None),
])
def test_extract_answer(text, strict, lenient):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "lenient") == lenient


def test_parse_number_edge_cases():
    assert parse_number("12.") == 12
    assert parse_number("12.0") == 12
    assert parse_number("$ 5") == 5
    assert parse_number("1/0") is None
    assert parse_number("abc") is None


def test_strict_format_only_on_final_line():
    assert has_strict_format("7 + 5 = 12\nAnswer: 12")
    assert has_strict_format("so...\nThe answer is 12.")
    assert not has_strict_format("so... The answer is 12.")  # not a line of its own
    assert not has_strict_format("Answer: 12\nand then I kept talking")
    assert not has_strict_format("12")


def test_rewards_on_conversational_completions():
    comps = [[{"role": "assistant", "content": "5+7=12\nAnswer: 12"}],
             [{"role": "assistant", "content": "it is 13"}],
             [{"role": "assistant", "content": "Answer: 11"}]]
    assert correctness_reward(None, comps, answer=["12", "12", "12"]) == [1.0, 0.0, 0.0]
    assert format_reward(None, comps) == [0.2, 0.0, 0.2]


def test_accuracy_strict_vs_lenient():
    acc = accuracy(["Answer: 3", "it is 3", "Answer: 4", "nothing"], ["3", "3", "3", "3"])
    assert acc == {"accuracy_strict": 0.25, "accuracy_lenient": 0.5}


def test_guarded_names_the_failing_function():
    def flaky_reward(prompts, completions, **kw):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="flaky_reward.*KeyError"):
        guarded(flaky_reward)(prompts=["p"], completions=["c"])

    def short_reward(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="short_reward.*returned 1 rewards for 2"):
        guarded(short_reward)(prompts=["p", "q"], completions=["c", "d"])

    def nan_reward(prompts, completions, **kw):
        return [math.nan, 1.0]

    with pytest.raises(RewardFunctionError, match="nan_reward.*non-finite"):
        guarded(nan_reward)(prompts=["p", "q"], completions=["c", "d"])
    assert guarded(format_reward).__name__ == "format_reward"


def test_guarded_async_stays_async_and_is_checked():
    """TRL runs `async def` rewards on its event loop (it tests `is_async_callable`): the guard must not hide that."""
    import asyncio

    from trl.trainer.utils import get_callable_name, is_async_callable

    async def judge(prompts, completions, **kw):
        return [0.5] * len(completions)

    async def short_judge(prompts, completions, **kw):
        return [0.5]

    wrapped = guarded(judge)
    assert is_async_callable(wrapped) and get_callable_name(wrapped) == "judge"
    assert asyncio.run(wrapped(prompts=["p", "q"], completions=["c", "d"])) == [0.5, 0.5]
    with pytest.raises(RewardFunctionError, match="short_judge.*returned 1 rewards for 2"):
        asyncio.run(guarded(short_judge)(prompts=["p", "q"], completions=["c", "d"]))


def test_guarded_without_strict_lets_through_what_trl_does():
    """reward_checks="trl": None and NaN mean "does not apply" (TRL nan-sums them away). Strict stops on NaN and
    names the flag that relaxes it; None alone is never the guard's business (the trainer checks rows)."""
    def blank(prompts, completions, **kw):
        return [None, math.nan]

    lenient = guarded(blank, strict=False)
    for _ in range(5):
        assert lenient(prompts=["p", "q"], completions=["c", "d"])[0] is None
    with pytest.raises(RewardFunctionError, match="blank.*non-finite.*--reward_checks trl"):
        guarded(blank)(prompts=["p", "q"], completions=["c", "d"])
    for _ in range(5):  # None for a whole batch, batch after batch: TRL's "applies to other rows"
        assert guarded(none_for_all)(prompts=["p", "q"], completions=["c", "d"]) == [None, None]


def none_for_all(prompts, completions, **kw):
    return [None] * len(completions)


def test_strict_row_check_stops_only_on_a_blank_row():
    """A row that no reward scored is blank; None from one reward beside another's score is not (issue 38)."""
    import torch

    from grpo_accel.trainer.callbacks.guards import check_reward_rows

    nan = math.nan
    names = ["math", "code", "judge"]
    check_reward_rows(torch.tensor([[1.0, nan, 0.5], [nan, 0.0, 0.5]]), names, [2])  # each row scored by some
    check_reward_rows(torch.tensor([[1.0, nan], [0.0, nan]]), names[:2], [])  # one reward None for a whole batch
    with pytest.raises(RewardFunctionError, match=r"1 of 2 completions got no reward.*row 1.*--reward_checks trl"):
        check_reward_rows(torch.tensor([[1.0, nan], [nan, nan]]), names[:2], [])
    with pytest.raises(RewardFunctionError, match=r"reward model 'judge' gave non-finite.*--reward_checks trl"):
        check_reward_rows(torch.tensor([[1.0, nan, math.inf]]), names, [2])


def test_resolve_rewards():
    assert resolve_rewards("correctness,format") == [correctness_reward, format_reward]
    assert resolve_rewards("grpo_accel.data.rewards:format_reward") == [format_reward]
    with pytest.raises(RewardFunctionError, match="neither built in"):
        resolve_rewards("nope")
