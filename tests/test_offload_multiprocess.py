"""The offloaded checkpoint on 2 processes over gloo: the full gradients equal one process's on the same global batch
(fp32, <= 1e-5 relative), under DeepSpeed ZeRO-2 with the re-run in row groups and in sequence tiles, and with
several forwards before one backward (log-prob mini-batches) under ZeRO-2, ZeRO-3 and torch DDP; LoRA adapters and
bf16 / fp16 under each engine (DeepSpeed's fp16 refuses a CPU: "Type fp16 is not supported on your device", so
ZeRO x fp16 waits for a GPU pair). The checkpoint
Function returns each layer's parameter grads (summed over its pieces), so autograd sums them over the forwards and
each parameter's reduce hook fires once per backward: a nested backward per checkpoint node fired it per forward
(ZeRO-2: "has already been reduced. Gradient computed twice"; DDP: "Expected to mark a variable ready only once";
ZeRO-3: an assertion on the bucket's parameter ids). ZeRO-3 partitions re-run whole, their grads made ready for
the reduce by the last pending node (grpo_accel.offload.rerun.zero3_last_use). One launch runs them all (~20 s on
2 CPU cores; each launch costs ~15 s of imports)."""

import os
import sys

import pytest
import torch
from support.compare import assert_allclose, rel_norm
from support.launch import ROOT, WORKERS, child_env, free_port, run_process_group

pytestmark = pytest.mark.distributed

RUNS = ["zero2:grouped", "zero2:tiled", "zero2:several", "ddp:several", "ddp:tiled", "zero3:grouped", "zero3:tiled",
        "zero3:several", "zero2:lora", "ddp:lora", "zero3:lora", "zero2:bf16", "ddp:bf16", "ddp:fp16", "zero3:bf16"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero") / "grads.pt"
    cmd = [sys.executable, os.path.join(WORKERS, "zero_rerun_worker.py"), "--runs", ",".join(RUNS),
           "--out", str(out), "--port", str(free_port())]
    proc = run_process_group(cmd, 300, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def assert_same_grads(got, ref):
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        assert g is not None and g.norm() > 0, name
        assert_allclose(got[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=name)


def test_pieces_under_zero_give_one_process_grads(result):
    runs = ("zero2:grouped", "zero2:tiled", "ddp:tiled", "zero3:grouped", "zero3:tiled")
    for run in runs:
        assert_same_grads(result[run]["grads"], result[run]["reference"]["grads"])
    # ZeRO-2 / DDP: both layers re-ran in pieces, their grads returned by the checkpoint Function; ZeRO-3: whole
    assert [result[r]["returned"] for r in runs] == [2, 2, 2, 0, 0]


@pytest.mark.parametrize("run", ["zero2:several", "ddp:several", "zero3:several"])
def test_several_forwards_one_backward_give_one_process_grads(result, run):
    assert_same_grads(result[run]["grads"], result[run]["reference"]["grads"])
    # 2 forwards x 2 layers returned their grads; ZeRO-3 partitions went the nested-backward way
    assert result[run]["returned"] == (0 if run.startswith("zero3") else 4)


@pytest.mark.parametrize("engine", ["zero2", "ddp", "zero3"])
def test_lora_adapter_grads_equal_one_process(result, engine):
    """LoRA x ZeRO-2 / DDP / ZeRO-3 with offload on: only the adapters are trainable, their grads as one process's."""
    run = result[f"{engine}:lora"]
    assert run["grads"] and all("lora_" in n for n in run["grads"])
    assert_same_grads(run["grads"], run["reference"]["grads"])


@pytest.mark.parametrize("run", ["zero2:bf16", "ddp:bf16", "ddp:fp16", "zero3:bf16"])
def test_half_precision_grads_equal_one_process_within_its_rounding(result, run):
    """bf16 / fp16 x ZeRO-2 / DDP / ZeRO-3 with offload on (DeepSpeed's own bf16; DDP under autocast). Two processes
    and one round differently in half precision (batched matmuls reduce over other rows, the engine reduces in its
    dtype), so each grad must equal one process's within 2x that process's own half-precision error against fp32
    (measured <= 1.2x). A wrong reduction (a grad summed, not averaged, or reduced twice) is off by >= 100%."""
    ref, got = result[run]["reference"], result[run]["grads"]
    assert got.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        half_err = rel_norm(g, ref["fp32"][name])
        assert 0 < half_err < 0.1, (name, half_err)  # really half precision, and close to fp32
        assert rel_norm(got[name], g) <= 2 * half_err, name


@pytest.mark.gpu
def test_zero_fp16_on_a_gpu_equals_one_process_within_its_rounding(tmp_path):
    """ZeRO-2 / ZeRO-3 x fp16: DeepSpeed's fp16 refuses a CPU, so these run on CUDA, one rank per GPU there is (the
    lent machines have one: the engine's fp16 path and our returned grads, without a cross-rank reduce). Same bound as
    the CPU half runs: within 2x one plain process's own fp16 error against fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (DeepSpeed fp16)")
    world = min(2, torch.cuda.device_count())
    out = tmp_path / "fp16.pt"
    cmd = [sys.executable, os.path.join(WORKERS, "zero_rerun_worker.py"), "--world", str(world),
           "--runs", "zero2:fp16,zero3:fp16", "--out", str(out), "--port", str(free_port())]
    proc = run_process_group(cmd, 300, cwd=ROOT, env=child_env(ZERO_RERUN_DEVICE="cuda"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out)
    for run in ("zero2:fp16", "zero3:fp16"):
        test_half_precision_grads_equal_one_process_within_its_rounding(result, run)
