"""Datasets: built-in synthetic arithmetic (seeded, disjoint splits) and the user's own, in TRL's formats.

--dataset takes TRL's prompt datasets as TRL's trainer does (a `prompt` column, text or chat messages; every other
column goes to the rewards as a keyword argument) and GSM8K-style `question`/`answer` rows (turned into chat
prompts with the arithmetic system prompt; `answer` becomes the bare number), from a file (JSONL, JSON, Parquet,
CSV), a directory or a hub name.

    python -c "from grpo_accel.data.datasets import arithmetic_dataset; print(arithmetic_dataset('train', 3)[0])"
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass

from grpo_accel.core.errors import UserError

# Short on purpose: every prompt token is paid for in each of the G sampled sequences' forward and backward
# (64 → 38 prompt tokens cut a CPU demo step by ~25%).
SYSTEM_PROMPT = "Reason briefly, then give the final answer on its own line as 'Answer: N'."

# Difficulty levels of the synthetic set. Level 1 is the demo's: "What is a ± b?" with a, b in 1..30.
LEVELS = {
    1: dict(ops="+-", lo=1, hi=30, words=False),
    2: dict(ops="+-*", lo=2, hi=60, words=True),
    3: dict(ops="+-*", lo=10, hi=400, words=True),
}
HELD_OUT_PERCENT = 25

_WORD_TEMPLATES = {
    "+": "{name} has {a} {thing}s and gets {b} more. How many {thing}s does {name} have now?",
    "-": "{name} has {a} {thing}s and gives away {b}. How many {thing}s does {name} have left?",
    "*": "{name} buys {a} boxes with {b} {thing}s in each box. How many {thing}s does {name} buy?",
}
_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade"]
_THINGS = ["apple", "marble", "sticker", "pencil", "coin", "book", "card", "shell"]


class DatasetError(UserError, ValueError):
    pass


def is_held_out(level: int, a: int, op: str, b: int) -> bool:
    """A problem's split is a pure function of its numbers: train and held-out can never share a pair."""
    digest = hashlib.sha256(f"{level}:{a}{op}{b}".encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def _problems(level: int, split: str):
    spec = LEVELS[level]
    want_held_out = split != "train"
    out = []
    for op in spec["ops"]:
        for a in range(spec["lo"], spec["hi"] + 1):
            for b in range(spec["lo"], spec["hi"] + 1):
                if op == "-" and spec["words"] and b > a:
                    continue  # "gives away more than it has" reads wrong in a word problem
                if op == "*" and a * b > 5000:
                    continue
                if is_held_out(level, a, op, b) == want_held_out:
                    out.append((a, op, b))
    return out


def _render(level: int, a: int, op: str, b: int, rng: random.Random) -> str:
    if not LEVELS[level]["words"]:
        return f"What is {a} {op} {b}?"
    return _WORD_TEMPLATES[op].format(name=rng.choice(_NAMES), thing=rng.choice(_THINGS), a=a, b=b)


def make_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def arithmetic_rows(split: str = "train", n: int = 1000, level: int = 1, seed: int = 0) -> list[dict]:
    """`n` problems drawn (seeded) from one split; the same arguments always give the same rows."""
    if split not in ("train", "test", "heldout"):
        raise DatasetError(f"unknown split {split!r}. Fix: use 'train' or 'test'.")
    if level not in LEVELS:
        raise DatasetError(f"unknown level {level}. Fix: use one of {sorted(LEVELS)}.")
    rng = random.Random(f"{seed}:{split}:{level}")
    pool = _problems(level, split)
    picks = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
    rows = []
    for a, op, b in picks:
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = _render(level, a, op, b, rng)
        rows.append({"prompt": make_prompt(question), "question": question, "answer": str(answer)})
    return rows


def arithmetic_dataset(split: str = "train", n: int = 1000, level: int = 1, seed: int = 0):
    from datasets import Dataset

    return Dataset.from_list(arithmetic_rows(split, n, level, seed))


def _gsm8k_answer(text: str) -> str:
    return text.split("####")[-1].strip().replace(",", "")


def read_jsonl(path: str) -> list[dict]:
    """Rows of a JSONL file; a malformed line is reported with its line number."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset file {path!r} does not exist. Fix: check the path, or use --dataset arithmetic.")
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg}). Fix that line or remove it.") from exc
    if not rows:
        raise DatasetError(f"dataset file {path!r} is empty. Fix: point --dataset at a file with rows.")
    return rows


# What --dataset reads from a file, by its ending (datasets' builder for each); .jsonl goes through read_jsonl.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# A held-out split, by the names datasets on the hub use for it (first one present wins).
HELD_OUT_SPLITS = ("test", "validation", "valid", "eval")


def _system_prompt(flag: str | None, default: str | None) -> str | None:
    """--system_prompt: None (not given) → the data's default; 'none' or '' → no system message; else the text."""
    if flag is None:
        return default
    return None if flag.strip().lower() in ("", "none") else flag


def rows_to_prompts(rows: list[dict], source: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    """Rows with `question` + `answer` (GSM8K's '#### N' or a bare number) → prompt rows; other columns stay (TRL
    hands them to the rewards)."""
    out = []
    for row in rows:
        question = row["question"]
        prompt = make_prompt(question, system_prompt) if system_prompt else [{"role": "user", "content": question}]
        out.append({**row, "prompt": prompt, "answer": _gsm8k_answer(str(row["answer"]))})
    return out


def _prompt_format(prompt) -> str | None:
    """'standard' (text), 'conversational' (a list of {'role', 'content'} messages, TRL's format) or None."""
    if isinstance(prompt, str):
        return "standard"
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        return "conversational"
    return None


def prompt_rows(rows: list[dict], source: str, system_prompt: str | None) -> list[dict]:
    """TRL's prompt datasets as they are: every row's `prompt` in one format, its other columns untouched.
    --system_prompt puts a system message first in each conversation (replacing the row's own)."""
    formats = {_prompt_format(row["prompt"]) for row in rows}
    bad = next((i for i, row in enumerate(rows) if _prompt_format(row["prompt"]) is None), None)
    if bad is not None:
        raise DatasetError(f"{source}: row {bad + 1}'s 'prompt' is {str(rows[bad]['prompt'])[:80]!r}: neither text nor "
                           f"a list of {{'role', 'content'}} messages. Fix: one of TRL's two prompt formats per row.")
    if len(formats) > 1:
        raise DatasetError(f"{source}: some prompts are text and some are chat messages. Fix: one format for every "
                           f"row (TRL's trainer takes one or the other).")
    if system_prompt is None:
        return rows
    if formats == {"standard"}:
        raise DatasetError(f"{source}: --system_prompt needs chat-message prompts, and these are plain text. Fix: "
                           f"leave --system_prompt out, or write the prompts as [{{'role': 'user', 'content': ...}}].")
    system = {"role": "system", "content": system_prompt}
    return [{**row, "prompt": [system, *[m for m in row["prompt"] if m["role"] != "system"]]} for row in rows]


def normalize_rows(rows: list[dict], source: str, system_prompt: str | None = None) -> tuple[list[dict], str]:
    """(training rows, kind): kind 'prompt' for TRL's prompt datasets, 'qa' for question/answer rows (GSM8K's
    format, given the arithmetic system prompt unless --system_prompt says otherwise)."""
    if all("prompt" in row for row in rows):
        return prompt_rows(rows, source, _system_prompt(system_prompt, None)), "prompt"
    if all("question" in row and "answer" in row for row in rows):
        return rows_to_prompts(rows, source, _system_prompt(system_prompt, SYSTEM_PROMPT)), "qa"
    i, row = next((i, r) for i, r in enumerate(rows) if "prompt" not in r and not {"question", "answer"} <= r.keys())
    raise DatasetError(f"{source}: row {i + 1} has no 'prompt' column, nor 'question' and 'answer' (it has "
                       f"{sorted(row)}). Fix: a 'prompt' column (text or chat messages, TRL's formats; other columns "
                       f"go to the rewards) or 'question' and 'answer' columns (GSM8K's format).")


def _load_file(path: str) -> list[dict]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl" or ext not in FILE_BUILDERS:  # a file without a known ending: read as JSONL, as before
        return read_jsonl(path)
    from datasets import load_dataset

    try:
        rows = list(load_dataset(FILE_BUILDERS[ext], data_files=path, split="train"))
    except Exception as exc:  # a malformed file, in the builder's words
        raise DatasetError(f"{path} could not be read as {ext[1:]} ({type(exc).__name__}: {str(exc)[:200]}). "
                           f"Fix: check the file, or save it as JSONL.") from exc
    if not rows:
        raise DatasetError(f"dataset file {path!r} is empty. Fix: point --dataset at a file with rows.")
    return rows


def _load_splits(name: str, config: str | None) -> dict:
    """{split: rows} of a directory (its files by split name, as datasets reads them) or a hub dataset."""
    from datasets import load_dataset

    try:
        try:
            loaded = load_dataset(name, config)
        except ValueError as exc:  # several configurations: 'main' where there is one (GSM8K's, our old default)
            if config is not None or "Config name is missing" not in str(exc) or "'main'" not in str(exc):
                raise
            loaded = load_dataset(name, "main")
    except Exception as exc:  # offline, a typo, a config to choose: the library's words, then the fix
        raise DatasetError(
            f"dataset {name!r} could not be loaded ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). Fix: "
            f"a local file (.jsonl, .parquet, .csv) or directory, a hub name with --dataset_config / --dataset_split "
            f"where it has several, or --dataset arithmetic.") from exc
    return {split: list(ds) for split, ds in loaded.items()}


@dataclass
class RunData:
    """What a run trains and evaluates on. kind: 'qa' (accuracy on answers) or 'prompt' (mean reward);
    held_out None: no evaluation, `note` says why in one line."""

    train: object  # datasets.Dataset
    held_out: object | None
    kind: str
    note: str = ""


def _subset(rows: list[dict], n: int | None, seed: int) -> list[dict]:
    """All rows in their order when n covers them (as TRL would train on them), else a seeded sample of n."""
    return rows if n is None or n >= len(rows) else random.Random(seed).sample(rows, n)


def load_run_data(name: str, train_size: int, eval_size: int, level: int = 1, seed: int = 0,
                  config: str | None = None, split: str = "train", system_prompt: str | None = None) -> RunData:
    """--dataset: 'arithmetic' (built-in, disjoint held-out split), a file (.jsonl, .json, .parquet, .csv), a
    directory or a hub name (--dataset_config, --dataset_split). The held-out rows come from the data's own test /
    validation split; without one, question/answer rows lend a seeded eval_size of theirs and prompt rows get none."""
    from datasets import Dataset

    if name in ("arithmetic", "synthetic"):
        prompt = _system_prompt(system_prompt, SYSTEM_PROMPT)
        train, test = (_with_system(arithmetic_rows(s, n or 1, level, seed), prompt) for s, n in
                       (("train", train_size), ("test", eval_size)))
        return RunData(Dataset.from_list(train), Dataset.from_list(test) if eval_size else None, "qa")
    if (name.startswith((".", "/", "~")) or name.lower().endswith(tuple(FILE_BUILDERS))) and not os.path.exists(
            os.path.expanduser(name)):
        raise DatasetError(f"dataset path {name!r} does not exist. Fix: check the path, or use --dataset arithmetic.")
    splits = {"train": _load_file(name)} if os.path.isfile(name) else _load_splits(name, config)
    if split not in splits:
        raise DatasetError(f"{name!r} has no split {split!r} (it has {sorted(splits)}). Fix: --dataset_split with "
                           f"one of those.")
    rows, kind = normalize_rows(splits[split], name, system_prompt)
    held_name = next((s for s in HELD_OUT_SPLITS if s in splits and s != split), None)
    if not eval_size:
        held, note = None, ""
    elif held_name is not None:
        held, note = _subset(normalize_rows(splits[held_name], name, system_prompt)[0], eval_size, seed), ""
    elif kind == "qa":  # a seeded share of the rows, never trained on
        rows = random.Random(seed).sample(rows, len(rows))
        held, rows = rows[:eval_size], rows[eval_size:]
        if not rows:
            raise DatasetError(f"{name!r} has {len(held)} rows, all taken by --eval_size {eval_size}. "
                               f"Fix: lower --eval_size or add rows.")
        note = ""
    else:
        held, note = None, (f"no held-out evaluation: {name} has no {'/'.join(HELD_OUT_SPLITS)} split (add one, "
                            f"e.g. a test file beside the train file in a directory)")
    train = as_dataset(_subset(rows, train_size, seed))
    return RunData(train, as_dataset(held) if held else None, kind, note)


def as_dataset(rows: list[dict]):
    """Dataset.from_list keeps only the first row's keys: a column some rows lack (a multi-task set's `tests`) would
    vanish. Every column, None where a row lacks it, as datasets' JSON reader gives it."""
    from datasets import Dataset

    keys = list(dict.fromkeys(k for row in rows for k in row))
    return Dataset.from_list([{k: row.get(k) for k in keys} for row in rows])


def _with_system(rows: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt == SYSTEM_PROMPT:
        return rows
    return [{**r, "prompt": make_prompt(r["question"], system_prompt) if system_prompt else r["prompt"][1:]}
            for r in rows]


def load_dataset_by_name(name: str, split: str = "train", n: int | None = None, seed: int = 0, level: int = 1):
    """One split of --dataset as a Dataset (see load_run_data): 'arithmetic', a file, a directory or a hub name."""
    if name in ("arithmetic", "synthetic"):
        return arithmetic_dataset(split, n or 2000, level=level, seed=seed)
    data = load_run_data(name, n or 10**9, 0, seed=seed, split=split)
    return data.train if n is None else as_dataset(_subset(list(data.train), n, seed))


def train_eval_datasets(name: str, train_size: int, eval_size: int, level: int = 1, seed: int = 0):
    """(train, held-out or None): load_run_data's two datasets."""
    data = load_run_data(name, train_size, eval_size, level=level, seed=seed)
    return data.train, data.held_out


def prompt_lengths(tokenizer, prompts) -> list[int]:
    """Tokens of each prompt as the trainer feeds it (chat template + generation prompt for conversations)."""
    return [len(tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=False))
            if isinstance(p, list) else len(tokenizer(p)["input_ids"]) for p in prompts]
