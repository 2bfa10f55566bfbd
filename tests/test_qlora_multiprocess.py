"""QLoRA on 2 processes over gloo: a saved tiny-llama loaded 4-bit (bitsandbytes NF4) with LoRA on every linear gives
the one-process adapter grads on the same global batch under torch DDP, DeepSpeed ZeRO-2 and ZeRO-3 (which partitions
the packed 4-bit weights too: their quant_state stays whole on each rank, and the gathered weight dequantizes as
before), and Ulysses SP = 2 gives the one-process log-probs, TRL loss and adapter grads. fp32 adapters and compute:
exact up to summation order, measured <= 1.1e-6 relative; the bound is 1e-5. One launch runs them all
(tests/workers/qlora_multiprocess_worker.py: ~100 s on 2 busy cores, ~60 s of it CPU time)."""

import os
import sys

import pytest
import torch
from support.compare import assert_rel_close, rel_norm
from support.launch import ROOT, WORKERS, child_env, free_port, run_process_group
from support.trainers import saved_tiny_model

pytestmark = pytest.mark.distributed
pytest.importorskip("bitsandbytes")

RUNS = ["ddp", "zero2", "sp", "zero3"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model_dir = saved_tiny_model(tmp_path_factory.mktemp("tiny-llama-saved"))
    out = tmp_path_factory.mktemp("qlora") / "result.pt"
    cmd = [sys.executable, os.path.join(WORKERS, "qlora_multiprocess_worker.py"), "--model_dir", str(model_dir),
           "--runs", ",".join(RUNS), "--out", str(out), "--port", str(free_port())]
    proc = run_process_group(cmd, 400, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in (0, 1)]


def assert_same_grads(got, ref):
    assert got.keys() == ref.keys() and len(ref) == 2 * 7 * 2  # A, B x 7 linears x 2 layers
    assert_rel_close(ref, got, 1e-5, nonzero=True)


@pytest.mark.parametrize("run", ["ddp", "zero2", "zero3"])
def test_adapter_grads_equal_one_process(result, run):
    out = result[0][run]
    assert "error" not in out, out.get("traceback")
    assert out["four_bit"] == 14  # every decoder linear is a 4-bit weight
    assert out["partitioned"] == (14 if run == "zero3" else 0)  # ZeRO-3 holds a partition of each on each rank
    assert_same_grads(out["grads"], out["reference"])


def test_sp2_equals_one_process(result):
    for rank in result:
        out = rank["sp"]
        (lp, ent, loss, grads), (lp0, ent0, loss0, grads0), scored = out["sp"], out["ref"], out["mask"].bool()
        assert out["sp_calls"] == 2  # the no-grad pass and the loss's policy pass went through SP
        assert rel_norm(lp[scored], lp0[scored]) <= 1e-5 and rel_norm(ent[scored], ent0[scored]) <= 1e-5
        assert loss.item() == pytest.approx(loss0.item(), rel=1e-5) and loss0.abs() > 1e-3
        assert_same_grads(grads, grads0)
