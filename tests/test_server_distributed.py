"""--vllm_mode server with LoRA under `accelerate launch` with DeepSpeed, 2 processes over gloo, one (stand-in)
server (support/vllm_standin.py): every rank joins the gather of the adapter's ZeRO-3 shards, rank 0 writes and
loads it, every rank trains on its share of each batch, and a server that stops answering stops every rank with one
error line within --vllm_server_timeout, the last checkpoint kept (issue 52, item 4)."""

import csv
import json
import os
import time

import pytest
import yaml
from safetensors.torch import load_file
from support.launch import ROOT, run_train
from support.vllm_standin import KEY, serve

from grpo_accel.generation.adapter_sync import API_KEY_ENV

pytestmark = pytest.mark.distributed
ACCELERATE = os.path.join(os.path.dirname(os.sys.executable), "accelerate")
RANK = 4
ARGS = ["--eval_size", "0", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--lora_r", str(RANK),
        "--lora_alpha", "8", "--lora_target_modules", "q_proj,v_proj", "--rewards", "support.rewards:length_reward",
        "--use_vllm", "true", "--vllm_mode", "server", "--max_staleness", "1", "--vllm_server_timeout", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "4"]


def config_file(stage, tmp_path) -> str:
    """The shipped cpu_zero<stage>.yaml; for ZeRO-3 with every parameter partitioned: DeepSpeed keeps those under
    stage3_param_persistence_threshold (1e5 elements) whole on each rank, which covers a tiny model's adapter (and an
    8B model's at r 16: 4096 x 16), so without 0 the adapter's gather would go untested. The threshold needs a
    DeepSpeed config file, beside which accelerate refuses its own ZeRO keys and mixed precision."""
    shipped = os.path.join(ROOT, "accelerate_configs", f"cpu_zero{stage}.yaml")
    if stage == 2:
        return shipped
    with open(shipped) as f:
        config = yaml.safe_load(f)
    config.pop("mixed_precision", None)
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          **{key: "auto" for key in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                     "gradient_accumulation_steps", "gradient_clipping")}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json"),
                                  "zero3_init_flag": config["deepspeed_config"]["zero3_init_flag"]}
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "zero3.yaml")


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_train_through_one_server(stage, tmp_path):
    """ZeRO-2: the adapter is whole on each rank. ZeRO-3: partitioned, so each version the server loads must hold
    the whole adapter (without the gather, PEFT writes empty tensors) and the launch must not hang. Under ZeRO-3 the
    server stops answering once v2 is loaded (step 3's batch, asked ahead at step 2, never comes): both ranks stop
    with the timeout's one error line, checkpoint-2 kept."""
    out = tmp_path / "run"
    slow = dict(slow_after_loads=3, slow_s=60.0) if stage == 3 else {}
    with serve(**slow) as (url, handler):
        t0 = time.monotonic()
        proc = run_train([*ARGS, "--vllm_server_base_url", url, "--output_dir", str(out)],
                         launcher=[ACCELERATE, "launch", "--config_file", config_file(stage, tmp_path)],
                         timeout=400, **{API_KEY_ENV: KEY})
        took = time.monotonic() - t0
        loads, requests = list(handler.loads), list(handler.requests)
    assert proc.stdout.count(f"generation route vllm_server: {url}, adapter-only sync") == 1  # rank 0 says it
    # every version loaded holds the whole adapter: lora_A (r x 576) and lora_B (576 or 192 x r) on q and v
    for _, folder in loads[-2:]:
        if (folder / "adapter_model.safetensors").exists():
            tensors = load_file(folder / "adapter_model.safetensors")
            assert tensors and all(t.numel() > 0 and RANK in t.shape for t in tensors.values()), folder
    # one request per batch for both ranks' prompts (4 rows per rank, 4 completions each: one prompt per rank), not
    # one per rank
    assert requests and all(len(prompts) == 2 for _, prompts in requests), [len(p) for _, p in requests]
    if stage == 2:
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
        with open(out / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("loss")]
        assert [float(r["server/batches_ahead_frac"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
        assert [name.rsplit("-v", 1)[1] for name, _ in loads] == ["0", "1", "2", "3"]
        return
    assert proc.returncode != 0, (proc.stdout[-2000:], proc.stderr[-4000:])  # the ranks 2; the launcher 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "did not answer within 8 s" in errors[0], proc.stderr[-3000:]
    assert took < 300  # the slow server's 60 s never reached: no rank waited past the timeout in a collective
    assert (out / "checkpoint-2" / "trainer_state.json").exists()  # --resume_from_checkpoint latest continues
