"""2-process torch DDP (torchrun via accelerate; without CUDA it runs as MULTI_CPU over gloo) GRPO runs through
`accelerate launch ... launch/train.py`, tiny-llama with the demo preset's LoRA: packed rows equal padded rows
(packing x DDP) and our chunked head equals TRL's (fused head x DDP), step by step (loss, grad norm, reward,
entropy), with LoRA adapters as the trainable weights (DDP x LoRA). No preset ships a DDP YAML (one GPU needs none;
several use DeepSpeed), so the test writes one; a user's own `accelerate config` for several GPUs without DeepSpeed
is this. Three launches, ~1 min each on 2 cores."""

import csv
import json
import os

import pytest
from support.launch import DDP_YAML, TINY_ARGS, run_train

pytestmark = pytest.mark.distributed
ACCELERATE = os.path.join(os.path.dirname(os.sys.executable), "accelerate")
ARGS = [*TINY_ARGS, "--per_device_train_batch_size", "4", "--eval_size", "2", "--eval_max_new_tokens", "4",
        "--rewards", "support.rewards:length_reward_noting_rank"]


def launch(tmp_path, name, *extra):
    config = tmp_path / "cpu_ddp.yaml"
    config.write_text(DDP_YAML)
    out, ranks = tmp_path / name, tmp_path / f"{name}-ranks"
    ranks.mkdir()
    result = run_train([*ARGS, "--output_dir", str(out), *extra], timeout=400,
                       launcher=[ACCELERATE, "launch", "--config_file", str(config)], REWARD_RANKS_DIR=str(ranks))
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    # two processes scored their rows, each in accelerate's 2-process MULTI_CPU job (else DDP never wraps the model)
    seen = {"rank0": "2 MULTI_CPU", "rank1": "2 MULTI_CPU"}
    assert {p.name: p.read_text().replace("DistributedType.", "") for p in ranks.iterdir()} == seen
    assert json.loads((out / "resolved_config.json").read_text())["script"]["lora_r"] == 16  # the cpu preset's LoRA
    return list(csv.DictReader(open(out / "metrics.csv"))), result.stdout


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp"), "packed-chunked")


def assert_same_steps(a, b, rel):
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "reward", "entropy"):
            assert float(x[key]) == pytest.approx(float(y[key]), rel=rel, abs=1e-7), key
    assert float(a[0]["grad_norm"]) > 0


def test_packed_equals_padded_under_ddp(base, tmp_path):
    rows, stdout = base
    assert "padding_free: log-prob passes run on packed rows" in stdout
    padded, stdout = launch(tmp_path, "padded", "--padding_free", "false")
    assert "padding_free: log-prob passes run on packed rows" not in stdout
    assert_same_steps(rows, padded, rel=1e-5)


def test_our_head_equals_trls_under_ddp(base, tmp_path):
    rows, stdout = base
    assert "log-prob head: chunked" in stdout
    trl, stdout = launch(tmp_path, "trl-head", "--logprob_impl", "trl")
    assert "log-prob head: trl" in stdout
    assert_same_steps(rows, trl, rel=1e-4)  # as test_zero_our_head_matches_trls: chunked vs TRL's summation order
