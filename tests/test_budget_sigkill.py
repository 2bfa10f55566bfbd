"""--rollout_budget through launch/train.py, killed with SIGKILL (no handler runs) while the step after a checkpoint
is underway, then `--resume_from_checkpoint latest`: the completions the checkpoint carried are continued, and the
run trains what an uninterrupted run trains, step by step (issue 53, item 4).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_budget_sigkill.py

The reference is the same command uninterrupted (seeded, one thread: its steps repeat exactly). What the steps
trained is read from a reward that logs each scored batch (support.rewards:length_reward_logged): every group's
question and completion tokens, so a group admitted twice, lost, or continued from other tokens than the checkpoint
saved shows as a difference from the reference, not only as a different loss.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support.launch import ACCELERATE, DDP_YAML, ROOT, TINY_ARGS, child_env, run_train

# A random tiny model samples SmolLM2's 49K tokens near uniformly and almost never its EOS: 10,000 ids that end a
# completion (tests/test_carried_rollouts.py's EOS_IDS, here through TRL's --generation_kwargs) make ~20% of tokens
# end one, so groups finish apart. Rounds of 2 tokens against a limit of 12: the step takes its 2 groups from the 4
# in flight (its batch and the batch read ahead) as soon as 2 are complete, and carries the rest, partly decoded.
EOS = json.dumps({"eos_token_id": list(range(1000, 11000))})
ARGS = [*TINY_ARGS, "--max_steps", "6", "--save_steps", "2", "--eval_size", "0", "--save_total_limit", "3",
        "--rewards", "support.rewards:length_reward_logged", "--use_transformers_continuous_batching", "true",
        "--vllm_importance_sampling_correction", "true", "--rollout_budget", "2", "--generation_kwargs", EOS]
STEPS, CUT, G = 6, 2, 4  # G: TINY_ARGS' --num_generations
KEYS = ("loss", "reward", "grad_norm", "completions/mean_length", "sampling/importance_sampling_ratio/mean",
        "rollouts/rounds", "rollouts/carried_completions", "rollouts/prefill_tokens_again", "rollouts/slot_use",
        "rollouts/dropped_groups_total", "rollouts/in_flight_groups")


def rows(out):
    return {int(float(r["step"])): r for r in csv.DictReader(open(out / "metrics.csv"))}


def scored(log):
    """Per step (1-based), the groups it trained: (question, its G completions' token ids), in the order scored."""
    steps = {}
    for line in log.read_text().splitlines():
        call = json.loads(line)
        steps.setdefault(call["steps_done"] + 1, []).extend(zip(call["question"], map(tuple, call["completion_ids"])))
    assert all(len({q for q, _ in r[i:i + G]}) == 1 for r in steps.values() for i in range(0, len(r), G))
    return {s: [(r[i][0], tuple(c for _, c in r[i:i + G])) for i in range(0, len(r), G)] for s, r in steps.items()}


def in_flight(checkpoint):
    state = json.loads((checkpoint / "rollouts-rank0.json").read_text())
    return state, {g["group_id"]: g for g in state["buffer"]["groups"]}


def sigkill_mid_step(cmd, checkpoint, log, env, stderr, timeout=300):
    """Start `cmd`; once `checkpoint` is complete (its trainer_state.json parses) and the step after it has scored
    its groups (a line in the reward `log`), SIGKILL the process group: that step's generation is done, its update
    and the next checkpoint are not. The run's stderr goes to the file `stderr` (a pipe nobody reads fills up)."""
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while proc.poll() is None and time.time() < deadline:
            try:
                json.loads((checkpoint / "trainer_state.json").read_text())
                if any(json.loads(line)["steps_done"] == CUT for line in log.read_text().splitlines()):
                    break
            except (OSError, ValueError):  # not written yet, or half written
                pass
            time.sleep(0.02)
        assert proc.poll() is None and time.time() < deadline, \
            f"no kill: the run ended or ran past {timeout} s first:\n{stderr.read_text()[-3000:]}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigkill_mid_step_then_resume_continues_the_carried_rollouts(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = run_train([*ARGS, "--output_dir", str(full)], REWARD_LOG=str(tmp_path / "full.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]

    killed_log = tmp_path / "killed.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *ARGS, "--output_dir", str(cut)]
    sigkill_mid_step(cmd, cut / f"checkpoint-{CUT}", killed_log, child_env(REWARD_LOG=str(killed_log)),
                     tmp_path / "killed.stderr")
    assert not (cut / "final").exists() and not (cut / f"checkpoint-{CUT + 2}").exists()
    # The run the test is about: the checkpoint holds completions in flight, partly decoded (a carry), and the
    # prompts read ahead, as the uninterrupted run's checkpoint does.
    saved, saved_groups = in_flight(cut / f"checkpoint-{CUT}")
    partial = [r for g in saved_groups.values() for r in g["rollouts"] if r["completion_ids"] and not r["finished"]]
    assert partial and saved["ahead"], f"nothing carried at checkpoint-{CUT}: the test no longer exercises a carry"
    assert saved == in_flight(full / f"checkpoint-{CUT}")[0]

    # Saves a SIGKILL cut short after the rollouts were written (trainer/checkpoints.py's rule: trainer_state.json,
    # written last, completes a checkpoint): one killed right after rollouts-rank0.json, one in its trainer state.
    (cut / f"checkpoint-{CUT + 1}").mkdir()
    shutil.copy(cut / f"checkpoint-{CUT}" / "rollouts-rank0.json", cut / f"checkpoint-{CUT + 1}")
    shutil.copytree(cut / f"checkpoint-{CUT}", cut / f"checkpoint-{CUT + 2}")
    state = (cut / f"checkpoint-{CUT}" / "trainer_state.json").read_text()
    (cut / f"checkpoint-{CUT + 2}" / "trainer_state.json").write_text(state[:len(state) // 2])

    resumed_log = tmp_path / "resumed.jsonl"
    resumed = run_train([*ARGS, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"],
                        REWARD_LOG=str(resumed_log))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {cut / f'checkpoint-{CUT}'}" in resumed.stdout
    for partial_save in (CUT + 1, CUT + 2):
        assert f"skipping incomplete checkpoint {cut / f'checkpoint-{partial_save}'}" in resumed.stdout

    # Every step logged once, each as the uninterrupted run logged it (the carry's counters included).
    a, b = rows(full), rows(cut)
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in KEYS:
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-8), (step, key)

    # What each step trained: the killed run's steps up to the checkpoint, then the resumed run's, are the
    # uninterrupted run's groups with the same tokens. The step the kill cut short scored before the kill and was
    # scored again after the resume (nothing of it was saved): the same groups, the same tokens.
    reference, killed, again = scored(tmp_path / "full.jsonl"), scored(killed_log), scored(resumed_log)
    assert sorted(killed) == list(range(1, CUT + 2)) and sorted(again) == list(range(CUT + 1, STEPS + 1))
    assert killed[CUT + 1] == again[CUT + 1]
    assert {**{s: killed[s] for s in range(1, CUT + 1)}, **again} == reference

    # Nothing generated twice, nothing lost: each group trained once; the carried ones go on from their saved
    # tokens; admitted = trained + dropped past max_staleness + still in flight at the end, as uninterrupted.
    trained = [q for s in sorted(reference) for q, _ in reference[s]]
    assert len(trained) == len(set(trained)) == STEPS * 2
    completions = {q: c for s in again for q, c in again[s]}
    continued = 0
    for g in saved_groups.values():
        question = g["inputs"]["question"]
        if question in completions:
            for r, ids in zip(g["rollouts"], completions[question], strict=True):
                assert list(ids[:len(r["completion_ids"])]) == r["completion_ids"], question
                continued += bool(r["completion_ids"]) and not r["finished"]
    assert continued, "no completion carried at the checkpoint trained after the resume"
    end, end_groups = in_flight(cut / f"checkpoint-{STEPS}")
    assert end == in_flight(full / f"checkpoint-{STEPS}")[0]
    assert not {g["inputs"]["question"] for g in end_groups.values()} & set(trained)
    dropped = int(float(b[STEPS]["rollouts/dropped_groups_total"]))
    assert end["next_group_id"] == len(trained) + dropped + len(end_groups)


# sitecustomize for the launched processes: rank 1 writes its rollouts $SAVE_DELAY_S late, as a rank descheduled or
# on a slow disk would; and transformers' store_flos (the first thing its checkpoint save does) without its all-gather,
# which every rank enters after writing its rollouts and so orders the writes by accident: what is left to order them
# is save_rollouts' own barrier. Each patched store_flos leaves a file in $HOOK_MARKS (the patch ran, on every rank).
# BudgetMode.save looks save_rollouts up in its module when it runs, so the module is patched as it is imported.
LATE_RANK = """
import importlib.abc, importlib.machinery, os, sys, time


def late_rank1(module):
    save = module.save_rollouts

    def late(trainer, *rest):
        if trainer.accelerator.process_index == 1:
            time.sleep(float(os.environ["SAVE_DELAY_S"]))
        return save(trainer, *rest)

    module.save_rollouts = late


def store_flos_alone(module):
    def store_flos(self):  # transformers' single-process branch: no collective
        self.state.total_flos += self.current_flos
        self.current_flos = 0
        open(os.path.join(os.environ["HOOK_MARKS"], f"store_flos-rank{self.args.process_index}"), "a").close()

    module.Trainer.store_flos = store_flos


PATCHES = {"grpo_accel.trainer.carried_rollouts": late_rank1, "transformers.trainer": store_flos_alone}


class Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            PATCHES[name](module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Patch())
"""


@pytest.mark.distributed
def test_no_trainer_state_before_every_ranks_rollouts(tmp_path):
    """Two processes (DDP over gloo): rank 0 must not complete a checkpoint (trainer_state.json) before every rank
    has written its rollouts-rank<k>.json, or a SIGKILL in between leaves a checkpoint that `latest` picks and whose
    resume fails on rank 1's missing rollouts. Rank 1 is made to write its rollouts 5 s late, and transformers'
    store_flos all-gather (at the start of its save, after the rollouts: it ordered the writes by accident) is taken
    out, so the order is save_rollouts' barrier's alone."""
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(LATE_RANK)
    config = tmp_path / "ddp.yaml"
    config.write_text(DDP_YAML)
    out = tmp_path / "out"
    args = [*ARGS, "--max_steps", "2", "--rewards", "support.rewards:length_reward", "--output_dir", str(out)]
    done = run_train(args, launcher=[ACCELERATE, "launch", "--config_file", str(config)], timeout=400,
                     PYTHONPATH=os.pathsep.join([str(hook), os.path.join(ROOT, "tests"), ROOT]), SAVE_DELAY_S="5",
                     HOOK_MARKS=str(marks))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["store_flos-rank0", "store_flos-rank1"], "not patched"
    written = {p.name: p.stat().st_mtime_ns for p in (out / f"checkpoint-{CUT}").iterdir()}
    assert written["rollouts-rank1.json"] - written["rollouts-rank0.json"] > 4e9, "rank 1 was not made late"
    assert written["rollouts-rank1.json"] < written["trainer_state.json"], written


@pytest.mark.distributed
def test_two_ranks_under_zero3_carry_and_resume_as_uninterrupted(tmp_path):
    """Two ranks, DeepSpeed ZeRO-3 over gloo (cpu_zero3.yaml), each with its own rollouts in flight: ranks decode
    different numbers of rounds and forwards a step (their completions end apart), which must not hang the launch
    (DeepSpeed's start-of-forward hook runs a collective while its trace is incomplete: TRL's unwrap for generation
    leaves it on); the checkpoint holds both ranks' rollouts, and the launch resumed from it logs what the
    uninterrupted launch logs, step by step."""
    launcher = [ACCELERATE, "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "cpu_zero3.yaml")]
    args = [*ARGS, "--max_steps", "4", "--save_steps", "2", "--rewards", "support.rewards:length_reward"]
    full = tmp_path / "full"
    done = run_train([*args, "--output_dir", str(full)], launcher=launcher, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = [json.loads((full / f"checkpoint-{CUT}" / f"rollouts-rank{k}.json").read_text()) for k in (0, 1)]
    assert saved[0]["buffer"]["groups"] != saved[1]["buffer"]["groups"]  # each rank its own groups
    assert any(r["completion_ids"] and not r["finished"] for s in saved for g in s["buffer"]["groups"]
               for r in g["rollouts"]), "nothing carried at the checkpoint: the resume proves nothing"
    cut = tmp_path / "cut"
    shutil.copytree(full / f"checkpoint-{CUT}", cut / f"checkpoint-{CUT}")
    resumed = run_train([*args, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"], launcher=launcher,
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = rows(full), rows(cut)
    assert sorted(b) == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's log history
    for step in b:
        for key in KEYS:
            assert float(b[step][key]) == pytest.approx(float(a[step][key]), rel=1e-5, abs=1e-8), (step, key)
