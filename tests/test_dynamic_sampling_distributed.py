"""--dynamic_sampling on two ranks under DeepSpeed ZeRO-3 through `accelerate launch ... launch/train.py`: refill
rounds run in lockstep (each rank samples the most groups any rank lacks: TRL's gathers and ZeRO-3's parameter
gathers are collective), so a rank whose group had a spread still samples while the other refills, and both train
a full batch every step. A rank that went on alone would hang the other in a gather (the launch's timeout)."""

import csv
import json
import os

import pytest
from support.launch import ACCELERATE, ROOT, run_train

pytestmark = pytest.mark.distributed


def test_two_ranks_refill_in_lockstep_under_zero3(tmp_path):
    out, log = tmp_path / "run", tmp_path / "rewards"
    config = os.path.join(ROOT, "accelerate_configs", "cpu_zero3.yaml")
    result = run_train(["--eval_size", "0", "--max_steps", "4", "--save_steps", "100", "--output_dir", str(out),
                        "--rewards", "support.rewards:half_flat_reward_logged_by_rank", "--dynamic_sampling", "true",
                        "--max_sampling_rounds", "4"],
                       launcher=[ACCELERATE, "launch", "--config_file", config], timeout=400, REWARD_LOG=str(log))
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    rounds = [[json.loads(line)["answers"] for line in open(f"{log}.rank{r}")] for r in (0, 1)]
    assert len(rounds[0]) == len(rounds[1]) > 4  # the same rounds on both ranks, refills among them
    flat = [[all(a % 2 == 0 for a in answers) for answers in rank] for rank in rounds]
    assert any(f0 != f1 for f0, f1 in zip(*flat)), "both ranks always agreed: lockstep went untested"
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 4 and max(float(r["dynamic_sampling/rounds"]) for r in rows) > 1
