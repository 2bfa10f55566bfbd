"""Ulysses sequence parallelism (grpo_accel/sequence_parallel.py) with SP = 2 over gloo equals one process: per-token
log-probs, entropies, TRL's loss and the LoRA gradients (fp32, <= 1e-5 relative), tiny-llama with LoRA on q/v/down,
completions of unequal length, layer offload with gradient checkpointing (the checkpoint's re-run in backward goes
through Ulysses' all-to-all again)."""

import os
import sys

import pytest
import torch

from launch_utils import ROOT, child_env, free_port, run_process_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_sp2_equals_one_process(tmp_path):
    out = tmp_path / "sp.pt"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "sequence_parallel_worker.py"), "--offload",
           "--out", str(out), "--port", str(free_port())]
    result = run_process_group(cmd, 300, cwd=ROOT, env=child_env())
    assert result.returncode == 0, result.stderr[-4000:]
    r = torch.load(out)
    ref, sp, scored = r["ref"], r["sp"], r["mask"].bool()
    assert sp["sp_calls"] == 2  # the no-grad pass and the loss's policy pass went through SP
    # each row ran as 2 shards of ceil(n / 2) tokens (rows of n real tokens, 2 layers, forward + re-run)
    assert sorted(set(sp["shard_lengths"])) == sorted({(n + 1) // 2 for n in r["row_tokens"].tolist()})
    assert rel(sp["logps"][scored], ref["logps"][scored]) <= 1e-5
    assert rel(sp["entropy"][scored], ref["entropy"][scored]) <= 1e-5
    assert sp["loss"].item() == pytest.approx(ref["loss"].item(), rel=1e-5) and ref["loss"].abs() > 1e-3
    assert ref["grads"].keys() == sp["grads"].keys() and len(ref["grads"]) == 12
    for name, g in ref["grads"].items():
        assert g.norm() > 0 and rel(sp["grads"][name], g) <= 1e-5, name
