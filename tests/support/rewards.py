"""Reward functions the end-to-end tests pass by import path (`--rewards support.rewards:digit_reward`)."""


def length_reward(prompts, completions, **kwargs):
    """Characters / 100: a random tiny model's samples (random tokens) differ in length, so advantages
    are non-zero and a training step must move the parameters."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 100 for t in texts]


def length_reward_that_warns(prompts, completions, **kwargs):
    """length_reward, warning once as a user's own code may: the run must still show a warning of its own after
    grpo_accel filters upstream ones the user cannot act on."""
    import warnings

    warnings.warn("support.rewards: a warning of the run's own", UserWarning, stacklevel=1)
    return length_reward(prompts, completions, **kwargs)


def broken_reward(prompts, completions, **kwargs):
    raise KeyError("solution")


def none_reward(prompts, completions, **kwargs):
    """'Does not apply' to every completion: a run on it alone would train on a blank reward."""
    return [None] * len(completions)


def wrong_count_reward(prompts, completions, **kwargs):
    return [0.0]


def nan_reward(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


NOT_CALLABLE = 3


def length_reward_noting_rank(prompts, completions, **kwargs):
    """length_reward that also writes $REWARD_RANKS_DIR/rank<R> holding how many processes accelerate counts and its
    distributed type: a multi-process test sees which ranks scored, and that accelerate (hence DDP's wrap and TRL's
    gathers) ran them as one distributed job."""
    import os
    from pathlib import Path

    import torch.distributed as dist
    from accelerate import PartialState

    rank = dist.get_rank() if dist.is_initialized() else 0
    state = PartialState()
    Path(os.environ["REWARD_RANKS_DIR"], f"rank{rank}").write_text(f"{state.num_processes} {state.distributed_type}")
    return length_reward(prompts, completions)


def length_reward_logged(prompts, completions, completion_ids, trainer_state, question, **kwargs):
    """length_reward that appends what it scored to the JSONL file $REWARD_LOG, one line a call: the optimizer steps
    done before it (the step scoring is that + 1), each row's question and completion token ids. A test reads which
    groups each step trained, and sees a step's generation done while the step is still running."""
    import json
    import os

    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"steps_done": trainer_state.global_step, "question": list(question),
                            "completion_ids": [[int(t) for t in ids] for ids in completion_ids]}) + "\n")
    return length_reward(prompts, completions)


def length_reward_logged_by_rank(prompts, completions, completion_ids, question, **kwargs):
    """length_reward that appends what this rank scored to $REWARD_LOG.rank<R>, one JSON line a call: each row's
    question (the rank's own rows, from its sampler) and the completion token ids it was handed for them. A
    multi-process test checks each rank trained the completions of its own prompts."""
    import json
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{os.environ['REWARD_LOG']}.rank{rank}", "a") as f:
        f.write(json.dumps({"question": list(question),
                            "completion_ids": [[int(t) for t in ids] for ids in completion_ids]}) + "\n")
    return length_reward(prompts, completions)


def _texts(completions):
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def scaled_length(prompts, completions, scale, **kwargs):
    """length_reward times the row's `scale` column: a reward that reads an extra dataset column (TRL passes it as
    a keyword argument), so a column lost or misaligned on the way changes the rewards."""
    return [len(t) / 100 * float(s) for t, s in zip(_texts(completions), scale)]


def math_reward(prompts, completions, task, scale, **kwargs):
    """Applies to the rows whose `task` is 'math' only (None elsewhere: TRL's documented multi-task case)."""
    return [len(t) / 100 * float(s) if k == "math" else None for t, k, s in zip(_texts(completions), task, scale)]


def code_reward(prompts, completions, task, **kwargs):
    """Applies to the 'code' rows only: the share of digits and spaces in the completion."""
    return [sum(ch.isdigit() or ch == " " for ch in t) / max(len(t), 1) if k == "code" else None
            for t, k in zip(_texts(completions), task)]


def never_applies(prompts, completions, **kwargs):
    """None for every row, batch after batch, beside rewards that score every row: must train (issue 38)."""
    return [None] * len(completions)


def half_flat_reward(prompts, completions, answer, **kwargs):
    """Flat (1.0 for each completion) on prompts with an even answer; elsewhere a spread whatever the completions
    (the row's place in its group of 4, rows of a group in a row) plus the completion's length."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if int(a) % 2 == 0 else (i % 4) / 10 + len(t) / 1000 for i, (a, t) in enumerate(zip(answer, texts))]


def half_flat_reward_logged_by_rank(prompts, completions, answer, **kwargs):
    """half_flat_reward that appends each call's answers to $REWARD_LOG.rank<R> (one JSON line a generation round):
    a multi-process test sees every rank's rounds."""
    import json
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{os.environ['REWARD_LOG']}.rank{rank}", "a") as f:
        f.write(json.dumps({"answers": [int(a) for a in answer]}) + "\n")
    return half_flat_reward(prompts, completions, answer)
