"""Rewards and answer extraction for math prompts.

Two readings of a completion's answer:
- strict: an explicit final answer (`Answer: N`, `The answer is N`, `\\boxed{N}`, GSM8K's `#### N`);
- lenient: the strict one if present, else the last number in the text ("last-number fallback").
Numbers are read robustly: `1,234`, `$12`, `12 apples`, `12.`, `12.0`, `-5`, `3/4` (a fraction
counts only when it is exact).

Rewards follow the recipe measured in DESIGN.md: 1.0 for a correct (lenient) answer, +0.2 for a
strict final line. TRL calls them as `f(prompts, completions, answer=[...], **kwargs) -> list[float]`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction

from grpo_accel.core.errors import UserError


class RewardFunctionError(UserError, RuntimeError):
    pass


RELAX_FLAG = "--reward_checks trl"  # the flag that turns the strict checks off (GRPOAccelConfig.reward_checks)


# 'org/name' on the hub (data/models.py's pattern, with the slash required)
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")

_NUM = r"-?\$?\s?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?"
_STRICT_PATTERNS = [
    re.compile(r"\\boxed\{\s*(" + _NUM + r")[^}]*\}"),
    re.compile(r"####\s*(" + _NUM + ")"),
    re.compile(r"(?:final\s+)?answer\s*(?:is|:|=)\s*\**\s*(" + _NUM + ")", re.IGNORECASE),
]
_ANY_NUMBER = re.compile(_NUM)
# The format reward wants the answer as the last line, e.g. "Answer: 12" or "The answer is 12."
_FINAL_LINE = re.compile(
    r"(?:^|\n)\s*(?:\*\*)?(?:final\s+)?(?:answer:|the answer is)\s*\**\s*" + _NUM + r"\s*\**\.?\s*$",
    re.IGNORECASE,
)


def parse_number(text: str) -> Fraction | None:
    """'$1,234.50' → 1234.5, '-3' → -3, '3/4' → 3/4; None when it is not a number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def completion_text(completion) -> str:
    """TRL passes conversational completions as [{'role': 'assistant', 'content': ...}]."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def extract_answer(text: str, mode: str = "lenient") -> Fraction | None:
    """The completion's final answer as a number, or None. `mode`: 'strict' | 'lenient'."""
    for pattern in _STRICT_PATTERNS:
        matches = pattern.findall(text)
        if matches:
            return parse_number(matches[-1])
    if mode == "strict":
        return None
    numbers = _ANY_NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def is_correct(text: str, answer: str, mode: str = "lenient") -> bool:
    got, want = extract_answer(text, mode), parse_number(str(answer))
    return got is not None and want is not None and got == want


def has_strict_format(text: str) -> bool:
    return bool(_FINAL_LINE.search(text.strip()))


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the (lenient) final answer equals the reference, else 0.0."""
    return [float(is_correct(completion_text(c), a)) for c, a in zip(completions, answer)]


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.2 for a strict final line `Answer: N` / `The answer is N.`, else 0.0."""
    return [0.2 * has_strict_format(completion_text(c)) for c in completions]


REWARDS = {"correctness": correctness_reward, "format": format_reward}
DEFAULT_REWARDS = (correctness_reward, format_reward)


def reward_names(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def is_reward_model_name(name: str) -> bool:
    """A --rewards entry that names a reward model: a local directory (or path), or an 'org/name' hub id. A bare
    word stays a (mistyped) function name, so its error says so."""
    if name in REWARDS or ":" in name:
        return False
    return os.path.isdir(name) or name.startswith((".", "/", "~")) or bool(_HUB_ID.fullmatch(name))


def resolve_rewards(spec: str) -> list:
    """--rewards: built-in names, importable 'module:function's and reward models (a local directory or an
    'org/name' hub id of a sequence-classification model; checked from its config here, loaded later by
    `load_reward_model`), comma-separated, in order."""
    funcs = []
    for name in reward_names(spec):
        if name in REWARDS:
            funcs.append(REWARDS[name])
        elif is_reward_model_name(name):
            funcs.append(reward_model_ref(name))
        else:
            funcs.append(_import_function(name))
    if not funcs:
        raise RewardFunctionError(f"no reward functions in {spec!r}. Fix: e.g. --rewards correctness,format")
    return funcs


def _import_function(name: str):
    import importlib

    module, _, attr = name.partition(":")
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RewardFunctionError(
            f"reward {name!r} is neither built in ({', '.join(REWARDS)}), an importable 'module:function' nor a "
            f"reward model ({type(exc).__name__}: {exc}). Fix: check the name and PYTHONPATH; a reward model is a "
            f"local directory or an org/name hub id."
        ) from exc
    if not callable(func):
        raise RewardFunctionError(f"reward {name!r} is a {type(func).__name__}, not a function. Fix: point "
                                  f"--rewards at a function (prompts, completions, **columns) -> list of floats.")
    return func


@dataclass(frozen=True)
class RewardModelRef:
    """A reward model named in --rewards, checked from its config (no weights read yet)."""

    name: str  # the local directory or hub id, as given
    config: object  # its transformers config


def reward_model_ref(name: str) -> RewardModelRef:
    """TRL's reward models: a sequence-classification model scoring a whole prompt + completion with one logit
    (TRL loads them with num_labels=1 and reads logits[:, 0]). Anything else fails here, before any weights."""
    from transformers import AutoConfig

    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise RewardFunctionError(f"reward model directory {name!r} does not exist. Fix: check the path.")
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(name))
    except Exception as exc:  # no config.json, offline, unknown repo
        raise RewardFunctionError(
            f"reward model {name!r}: no readable config ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). "
            f"Fix: a directory saved by AutoModelForSequenceClassification.save_pretrained, or a hub id with hub "
            f"access.") from exc
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardFunctionError(
            f"reward model {name!r} is a {archs[0]}, not a sequence classifier. Fix: a reward model saved from "
            f"AutoModelForSequenceClassification with num_labels=1 (TRL scores prompt + completion by its one logit).")
    if getattr(config, "num_labels", 1) != 1:
        raise RewardFunctionError(f"reward model {name!r} has {config.num_labels} labels; TRL loads reward models "
                                  f"with num_labels=1. Fix: a reward model with one output (a score).")
    return RewardModelRef(name, config)


def load_reward_model(ref: RewardModelRef, dtype):
    """(model, tokenizer) as TRL loads a reward model given by name (num_labels=1; the tokenizer's pad token is set
    by TRL's trainer), in the policy's dtype, without use_cache; our loading keeps the policy's model_init_kwargs
    (rope scaling) off it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.expanduser(ref.name)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    # One forward a batch, no generation: a k/v cache is never read, and would hold 2 kv per layer and token
    # until the forward returns (planning/memory.py reward_model_bytes). The scores are the same without it.
    model.config.use_cache = False
    return model, AutoTokenizer.from_pretrained(path)


def check_reward_weights(weights, rewards: list[str]) -> None:
    """TRL checks the count only once every model is loaded, in its own words: say it first, naming both flags."""
    if weights is not None and len(weights) != len(rewards):
        raise RewardFunctionError(f"--reward_weights has {len(weights)} weights for {len(rewards)} rewards "
                                  f"({', '.join(rewards)}). Fix: one weight per --rewards entry, in the same order.")


def accuracy(texts: list[str], answers: list[str]) -> dict[str, float]:
    """Strict and lenient accuracy of a batch of completions (fractions in [0, 1])."""
    n = max(len(texts), 1)
    return {
        "accuracy_strict": sum(is_correct(t, a, "strict") for t, a in zip(texts, answers)) / n,
        "accuracy_lenient": sum(is_correct(t, a, "lenient") for t, a in zip(texts, answers)) / n,
    }
