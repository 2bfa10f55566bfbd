"""--vllm_mode server with LoRA under `accelerate launch` with DeepSpeed, 2 processes over gloo (ZeRO-3: as the
multinode_zero3 preset's two machines on loopback, one process each), one (stand-in) server
(support/vllm_standin.py): every rank joins the gather of the adapter's ZeRO-3 shards, rank 0 writes and loads it,
every rank trains on its share of each batch (the completions the server answered for the rank's own prompts), and
a server that stops answering stops every rank with one error line (one a machine) within --vllm_server_timeout, the
last checkpoint kept (issue 52, item 4)."""

import csv
import json
import os
import time

import pytest
import yaml
from safetensors.torch import load_file
from support.launch import ACCELERATE, MULTINODE_YAML, ROOT, run_train, run_train_two_machines
from support.vllm_standin import KEY, serve
from transformers import AutoTokenizer

from grpo_accel.data.models import embedded_model_dir
from grpo_accel.generation.adapter_sync import API_KEY_ENV

pytestmark = pytest.mark.distributed
RANK = 4
ARGS = ["--eval_size", "0", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--lora_r", str(RANK),
        "--lora_alpha", "8", "--lora_target_modules", "q_proj,v_proj", "--rewards",
        "support.rewards:length_reward_logged_by_rank",
        "--use_vllm", "true", "--vllm_mode", "server", "--max_staleness", "1", "--vllm_server_timeout", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "4"]


def config_file(stage, tmp_path) -> str:
    """ZeRO-2: the shipped cpu_zero2.yaml. ZeRO-3: the shipped multinode_zero3.yaml (launched as two machines on
    loopback, support.launch.run_train_two_machines) with every parameter partitioned: DeepSpeed keeps those under
    stage3_param_persistence_threshold (1e5 elements) whole on each rank, which covers a small model's adapter (and
    an 8B model's at r 16: 4096 x 16), so without 0 the adapter's gather would go untested. The threshold needs a
    DeepSpeed config file, which carries the preset's ZeRO keys instead, and beside which accelerate refuses them
    and mixed precision (the loopback's --mixed_precision no says fp32)."""
    if stage == 2:
        return os.path.join(ROOT, "accelerate_configs", "cpu_zero2.yaml")
    with open(MULTINODE_YAML) as f:
        config = yaml.safe_load(f)
    config.pop("mixed_precision")
    zero = config["deepspeed_config"]
    ds = {"zero_optimization": {"stage": zero["zero_stage"], "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": zero["offload_optimizer_device"]},
                                "offload_param": {"device": zero["offload_param_device"]},
                                "stage3_gather_16bit_weights_on_model_save": zero["zero3_save_16bit_model"]},
          **{key: "auto" for key in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                     "gradient_accumulation_steps", "gradient_clipping")}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json"),
                                  **{key: zero[key] for key in ("zero3_init_flag", "deepspeed_multinode_launcher")}}
    (tmp_path / "multinode_zero3.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "multinode_zero3.yaml")


def assert_each_rank_trained_its_own_prompts(scored, answered):
    """Every row each rank scored (support.rewards:length_reward_logged_by_rank: its question, from its own sampler,
    and the completion it was handed) holds a completion the stand-in answered for a prompt asking that question:
    not another rank's share of the batch (the reward reads lengths only, so a rank on the wrong share still
    trains)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    for rank in (0, 1):
        calls = [json.loads(line) for line in open(f"{scored}.rank{rank}")]
        rows = [row for call in calls for row in zip(call["question"], call["completion_ids"])]
        assert rows, f"rank {rank} scored nothing"
        for question, ids in rows:
            asked = [tokenizer.decode(prompt) for _, prompt, _ in answered.get(tuple(ids), [])]
            assert asked, f"rank {rank} trained a completion the server never answered: {ids}"
            assert any(question in prompt for prompt in asked), \
                f"rank {rank} trained, for its row {question!r}, a completion the server answered for {asked}"


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_train_through_one_server(stage, tmp_path):
    """ZeRO-2: the adapter is whole on each rank. ZeRO-3, launched as two machines of one process each (the
    multinode_zero3 preset's launch): partitioned, so each version the server loads must hold the whole adapter
    (without the gather, PEFT writes empty tensors) and the launch must not hang. Under ZeRO-3 the server stops
    answering once v2 is loaded (step 3's batch, asked ahead at step 2, never comes): both machines stop with the
    timeout's error line, one each (its terminal), checkpoint-2 kept."""
    out, scored = tmp_path / "run", tmp_path / "scored.jsonl"
    args = [*ARGS, "--output_dir", str(out)]
    env = {API_KEY_ENV: KEY, "REWARD_LOG": str(scored)}
    slow = dict(slow_after_loads=3, slow_s=60.0) if stage == 3 else {}
    with serve(**slow) as (url, handler):
        t0 = time.monotonic()
        if stage == 2:
            procs = [run_train([*args, "--vllm_server_base_url", url], timeout=400, **env,
                               launcher=[ACCELERATE, "launch", "--config_file", config_file(stage, tmp_path)])]
        else:  # --preset: the YAML's name picks the 8B; cpu is what this launch trained on one machine (SmolLM2-135M)
            procs = run_train_two_machines(["--preset", "cpu", *args, "--vllm_server_base_url", url],
                                           config_file(stage, tmp_path), timeout=400, **env)
        took = time.monotonic() - t0
        loads, requests, answered = list(handler.loads), list(handler.requests), dict(handler.answered)
    stdout = "".join(proc.stdout for proc in procs)
    assert stdout.count(f"generation route vllm_server: {url}, adapter-only sync") == 1  # rank 0 says it
    # every version loaded holds the whole adapter: lora_A (r x hidden) and lora_B (hidden or kv width x r) on q, v
    for _, folder in loads[-2:]:
        if (folder / "adapter_model.safetensors").exists():
            tensors = load_file(folder / "adapter_model.safetensors")
            assert tensors and all(t.numel() > 0 and RANK in t.shape for t in tensors.values()), folder
    # one request per batch for both ranks' prompts (4 rows per rank, 4 completions each: one prompt per rank), not
    # one per rank
    assert requests and all(len(prompts) == 2 for _, prompts in requests), [len(p) for _, p in requests]
    assert_each_rank_trained_its_own_prompts(scored, answered)
    if stage == 2:
        assert procs[0].returncode == 0, (procs[0].stdout[-2000:], procs[0].stderr[-4000:])
        with open(out / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("loss")]
        assert [float(r["server/batches_ahead_frac"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
        assert [name.rsplit("-v", 1)[1] for name, _ in loads] == ["0", "1", "2", "3"]
        return
    assert "preset cpu: --preset cpu on the command line" in procs[0].stdout
    for proc in procs:  # machine 0 (rank 0), machine 1 (rank 1)
        assert proc.returncode != 0, (proc.stdout[-2000:], proc.stderr[-4000:])  # the rank 2; its launcher 1
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "did not answer within 8 s" in errors[0], proc.stderr[-3000:]
    assert took < 300  # the slow server's 60 s never reached: no rank waited past the timeout in a collective
    assert (out / "checkpoint-2" / "trainer_state.json").exists()  # --resume_from_checkpoint latest continues
