"""Memory planner arithmetic, named architectures, per-phase telemetry, and planner vs a measured CPU step.

    OMP_NUM_THREADS=1 pytest tests/test_memory.py -s      # -s prints the planner-vs-measured table
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_accel.core.phase_memory import PhaseMemory
from grpo_accel.planning.architectures import ARCHITECTURES, get_architecture, list_architectures, model_shape
from grpo_accel.planning.generation import engine_kv_bytes, kv_cache_sequences, vllm_memory_fraction
from grpo_accel.planning.memory import GIB, plan_memory

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# Parameter counts the model cards publish (rounded as they print them)
PUBLISHED_PARAMS = {"llama-3.1-8b": 8.03e9, "qwen3-8b": 8.2e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.61e9,
                    "llama-3.2-1b": 1.23e9, "smollm2-135m": 135e6, "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9,
                    "qwen3-30b-a3b": 30.5e9}
# Active parameters per token as the cards print them: gpt-oss's model card counts them without the input embedding
# (a lookup, not a matmul), Qwen's with it
PUBLISHED_ACTIVE = {"gpt-oss-20b": (3.6e9, True), "gpt-oss-120b": (5.1e9, True), "qwen3-30b-a3b": (3.3e9, False)}


# ---------------------------------------------------------------------------------------------- architectures

@pytest.mark.parametrize("name", list_architectures())
def test_named_architecture_param_count_matches_the_built_model(name):
    from transformers import AutoModelForCausalLM

    config = get_architecture(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model_shape(name).n_params == sum(p.numel() for p in model.parameters())
    assert model_shape(config).n_params == model_shape(name).n_params  # from the config object, same answer
    if name in PUBLISHED_PARAMS:
        assert model_shape(name).n_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_published_shapes():
    s = model_shape("llama-3.1-8b")
    assert (s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, s.vocab, s.tied) == \
        (32, 4096, 14336, 32, 8, 128, 128256, False)
    s = model_shape("qwen3-8b")
    assert (s.layers, s.hidden, s.intermediate, s.kv_heads, s.vocab, s.qk_norm) == (36, 4096, 12288, 8, 151936, True)
    assert model_shape("qwen2.5-1.5b").tied and not model_shape("qwen2.5-7b").tied
    assert get_architecture("llama-3.2-1b").rope_parameters["factor"] == 32.0
    assert get_architecture("qwen2.5-7b").rope_parameters["rope_theta"] == 1e6
    assert model_shape("Qwen/Qwen3-8B") == model_shape("qwen3-8b")  # hub names of known shapes resolve offline


def test_tiny_architectures_match_the_test_models():
    from grpo_accel.data.models import TINY_CONFIGS

    for name, spec in TINY_CONFIGS.items():
        s = model_shape(name)
        assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.tied) == (
            spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"],
            spec["num_attention_heads"], spec["num_key_value_heads"], spec["tie_word_embeddings"])


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_moe_active_params_match_the_cards(name):
    s = model_shape(name)
    published, without_embedding = PUBLISHED_ACTIVE[name]
    active = s.active_params - (s.vocab * s.hidden if without_embedding else 0)
    assert active == pytest.approx(published, rel=0.02)
    assert model_shape(name.replace("gpt-oss", "openai/gpt-oss").replace("qwen3-30b", "Qwen/Qwen3-30B")) == s


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_moe_shape_counts_the_built_model_per_kind(name):
    """Experts, routers, sinks and the trainable set under LoRA, each against the built tiny twin's parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    s, model = model_shape(name), AutoModelForCausalLM.from_config(get_architecture(name))
    params = dict(model.named_parameters())
    assert s.moe_layers * s.expert_params == sum(p.numel() for n, p in params.items() if ".experts." in n)
    router = ".router." if s.sinks else ".gate."
    assert s.moe_layers * s.router_params == sum(p.numel() for n, p in params.items() if router in n)
    assert s.sinks == any(n.endswith("sinks") for n in params)
    layer_types = getattr(model.config, "layer_types", None) or []
    assert s.sliding_layers == sum(t == "sliding_attention" for t in layer_types)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert s.lora_params(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)  # as PEFT places them


def test_moe_planner_terms():
    """gpt-oss-20b: experts are not quantized by QLoRA, full FT pays the expert-gradient transient, a sliding
    layer's KV cache holds its window only."""
    s = model_shape("gpt-oss-20b")
    q = plan_memory(s, model_dtype="bf16", quantization="4bit", lora_r=16)
    assert q.device["weights"] > s.moe_layers * s.expert_params * 2  # the experts alone, in bf16
    lora, full = (plan_memory(s, model_dtype="bf16", lora_r=r, max_completion_length=1024) for r in (16, 0))
    assert lora.device["gradients"] == s.lora_params(16) * 4
    assert full.device["gradients"] == s.n_params * 2 + 2 * s.expert_params * 2
    kv_full = 2 * s.layers * s.kv_dim * 2 * 8192
    assert s.kv_cache_bytes(8192, 2) == kv_full // 2 + 2 * s.sliding_layers * s.kv_dim * 2 * 128
    assert model_shape("qwen3-30b-a3b").kv_cache_bytes(8192, 2) == 2 * 48 * 4 * 128 * 2 * 8192  # no sliding layers


def test_model_shape_from_local_dir_and_clear_offline_error(tmp_path):
    get_architecture("qwen2.5-1.5b").save_pretrained(tmp_path)
    assert model_shape(tmp_path).n_params == model_shape("qwen2.5-1.5b").n_params
    assert model_shape(str(tmp_path / "config.json")).hidden == 1536
    with pytest.raises(ValueError, match="local directory with config.json"):  # HF_HUB_OFFLINE=1 in conftest
        model_shape("some-org/some-model-that-is-not-here")
    with pytest.raises(ValueError, match="config.json"):
        model_shape(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------- planner arithmetic

def test_8b_bf16_weights_are_16_gb():
    plan = plan_memory("llama-3.1-8b", model_dtype="bf16", lora_r=16)
    assert plan.device["weights"] == 2 * 8_030_261_248  # 16.06 GB
    q = plan_memory("llama-3.1-8b", model_dtype="bf16", quantization="4bit", lora_r=16)
    assert 5.0e9 < q.device["weights"] < 6.0e9  # NF4 decoder linears + bf16 embeddings/head (2.1 GB)


def test_naive_logits_match_design_figure():
    """DESIGN.md: G=8, T=20K, V=128K -> 78 GB, which is one fp32 [G*T, V] copy (T = 20480, V = 128256)."""
    G, T, V = 8, 20480, 128256
    one_fp32_copy = G * T * V * 4
    assert one_fp32_copy / GIB == pytest.approx(78.3, abs=0.1)
    plan = plan_memory("llama-3.1-8b", model_dtype="bf16", per_device_train_batch_size=G, max_completion_length=T,
                       logprob_impl="naive")
    assert plan.device["logprob_workspace"] == 3 * one_fp32_copy  # planner: 3 live copies in backward
    fused = plan.replan(logprob_impl="auto").device["logprob_workspace"]
    assert fused < 4 * GIB  # blocks (<= 1 GiB) + d(hidden) [N, H] bf16 (1.25 GiB) + per-token stats


def test_offload_moves_checkpointed_inputs_to_host():
    G, T, L, H = 8, 20480, 32, 4096
    # generation off these GPUs (a vLLM server): the difference below is offload's alone
    kw = dict(model_dtype="bf16", per_device_train_batch_size=G, max_prompt_length=0, max_completion_length=T,
              generation="vllm_server")
    on = plan_memory("llama-3.1-8b", offload_activations=True, **kw)
    off = plan_memory("llama-3.1-8b", offload_activations=False, **kw)
    assert off.device["activations_checkpointed"] == (L + 1) * G * T * H * 2  # L inputs + the head's input
    assert off.device["activations_checkpointed"] / 1e9 == pytest.approx(43, rel=0.05)  # DESIGN.md's 43 GB
    moved = off.device["activations_checkpointed"] - on.device["activations_checkpointed"]
    assert moved == on.host["activations_offloaded"] == (L + 1 - 2) * G * T * H * 2  # 2 stay for prefetch
    # the re-run in pieces of 16384 tokens: 20480-token rows one at a time, each in two sequence tiles
    rerun_saved = off.device["recompute_working_set"] - on.device["recompute_working_set"]
    assert rerun_saved > off.device["recompute_working_set"] * 7 / 8
    assert off.peak_bytes - on.peak_bytes == pytest.approx((moved + rerun_saved) * 1.05)  # with fragmentation


@pytest.mark.parametrize("preset", ["t4_qlora", "h100_110k", "8xh100_zero3_offload", "cpu"])
def test_peak_grows_with_completion_length(preset):
    from grpo_accel.app.presets import get_preset

    p = get_preset(preset)
    peaks = [p.plan(max_completion_length=t).peak_bytes for t in (64, 1024, 8192, 65536)]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


def test_zero_sharding_divides_states():
    kw = dict(model_dtype="bf16", lora_r=0, per_device_train_batch_size=1, max_completion_length=1024)
    single = plan_memory("qwen2.5-7b", **kw)
    z1, z2, z3 = (plan_memory("qwen2.5-7b", deepspeed_stage=s, num_processes=8, **kw) for s in (1, 2, 3))
    n = model_shape("qwen2.5-7b").n_params
    assert single.device["optimizer_states"] == n * 12  # fp32 master + Adam m, v
    assert z1.device["optimizer_states"] == n * 12 // 8 and z1.device["gradients"] == n * 2
    assert z2.device["gradients"] == n * 2 // 8 and z2.device["weights"] == n * 2
    s = model_shape("qwen2.5-7b")
    gathered = (2 * s.layer_linear_params + s.vocab * s.hidden) * 2  # 2 layers + the embedding, gathered at once
    assert z3.device["weights"] == pytest.approx(n * 2 / 8 + gathered, abs=1)
    off = plan_memory("qwen2.5-7b", deepspeed_stage=3, num_processes=8, offload_optimizer=True,
                      offload_params=True, **kw)
    assert off.device["optimizer_states"] == 0 and off.host["optimizer_states"] == n * 12 // 8
    assert off.device["weights"] < z3.device["weights"]


def test_lora_states_are_small_and_fp32():
    s = model_shape("qwen3-8b")
    plan = plan_memory(s, model_dtype="bf16", lora_r=16)
    assert plan.device["lora_weights"] == s.lora_params(16) * 4
    assert plan.device["optimizer_states"] == s.lora_params(16) * 8  # m, v; the adapter is its own fp32 master
    assert s.lora_params(16) == 36 * 16 * (8192 + 2 * 5120 + 8192 + 2 * 16384 + 16384)


def test_verdict_names_fixes_and_bisection_is_tight():
    plan = plan_memory("qwen3-8b", model_dtype="bf16", quantization="4bit", lora_r=16, per_device_train_batch_size=1,
                       max_completion_length=110_000, offload_activations=False, use_vllm=True)
    gpu = int(79.1 * GIB)
    v = plan.verdict(gpu)
    assert not v.fits and "--offload_activations true" in v.message
    fix = dict((text, ok) for text, _, ok in v.fixes)
    assert fix["--offload_activations true"] and plan.replan(offload_activations=True).verdict(gpu).fits
    t = int(next(text for text in fix if text.startswith("--max_completion_length")).split()[-1])
    assert plan.replan(max_completion_length=t).peak_bytes <= gpu
    assert gpu < plan.replan(max_completion_length=t + 128).peak_bytes
    bf16 = plan_memory("llama-3.1-8b", model_dtype="bf16", lora_r=16, per_device_train_batch_size=1,
                       max_completion_length=4096)
    assert "--quantization 4bit" in bf16.verdict(12 * GIB).message
    assert bf16.verdict(80 * GIB).fits and "fits" in str(bf16.verdict(80 * GIB))


def test_vllm_fraction_leaves_training_its_memory():
    from grpo_accel.app.presets import get_preset

    p = get_preset("a100_80gb_bf16")  # LoRA on bf16 weights: the engine shares them
    plan, gpu = p.plan(), int(79.1 * GIB)
    frac = vllm_memory_fraction(plan, gpu)
    assert frac * gpu >= plan.vllm_bytes  # the engine's weights (shared), minimum KV cache and runtime
    assert (1 - frac) * gpu >= plan.peak_bytes - plan.vllm_bytes  # training keeps what it needs
    assert kv_cache_sequences(plan, gpu) >= 1
    with pytest.raises(ValueError, match="does not fit"):
        vllm_memory_fraction(plan, int(20 * GIB))
    shared, own = plan, p.plan({"vllm_share_weights": False})
    assert own.route == "vllm_copy" and shared.route == "vllm_shared"
    assert own.device["vllm_weights"] == shared.device["weights"] and shared.device["vllm_weights"] == 0


def test_planner_mirrors_grouped_recompute():
    from grpo_accel.offload import OffloadConfig

    # the planner's default re-run piece is the offload's (one constant: core.settings.OFFLOAD_RECOMPUTE_TOKENS)
    assert plan_memory("llama-3.1-8b").inputs["offload_recompute_tokens"] == OffloadConfig().recompute_tokens
    kw = dict(num_generations=8, per_device_train_batch_size=8, max_prompt_length=64, max_completion_length=8192)
    whole, grouped = (plan_memory("llama-3.1-8b", offload_activations=o, **kw).device["recompute_working_set"]
                      for o in (False, True))
    assert grouped * 8 == whole  # 8256-token rows: one row per group
    ds = plan_memory("llama-3.1-8b", offload_activations=True, deepspeed_stage=2, num_processes=8, **kw)
    assert ds.device["recompute_working_set"] == grouped  # several processes: pieces too (grads handed back once)
    z3 = plan_memory("llama-3.1-8b", offload_activations=True, deepspeed_stage=3, num_processes=8, **kw)
    assert z3.device["recompute_working_set"] == whole  # ZeRO-3 partitions: whole re-run


# ---------------------------------------------------------------------------------------------- telemetry

def test_phase_memory_cpu_peaks_reset_and_nest():
    mem = PhaseMemory(device="cpu")
    with mem.phase("outer"):
        with mem.phase("big"):
            x = torch.ones(300 * MIB // 4)  # 300 MiB, touched
            del x
        with mem.phase("small"):
            y = torch.ones(20 * MIB // 4)
            del y
    rec = {r.name: r for r in mem.records}
    assert rec["big"].peak_bytes - rec["big"].start_bytes >= 290 * MIB
    assert rec["small"].peak_bytes - rec["small"].start_bytes < 150 * MIB  # the counter was reset
    assert rec["outer"].peak_bytes >= rec["big"].peak_bytes
    assert set(mem.metrics()) == {"memory/outer_peak_gib", "memory/big_peak_gib", "memory/small_peak_gib"}


def test_phase_memory_sampling_fallback_sees_a_short_peak():
    mem = PhaseMemory(device="cpu", interval_s=0.002)
    mem._hwm = False  # as on a kernel without clear_refs
    with mem.phase("hold"):
        x = torch.ones(200 * MIB // 4)
        time.sleep(0.05)
        del x
    r = mem.records[0]
    assert r.peak_bytes - r.start_bytes >= 190 * MIB


@pytest.mark.gpu
def test_phase_memory_cuda():
    mem = PhaseMemory(device="cuda")
    with mem.phase("alloc"):
        x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del x
    assert mem.records[0].peak_bytes - mem.records[0].start_bytes >= 256 * MIB


# ---------------------------------------------------------------------------------------------- planner vs measured

# One training step of a SmolLM2-135M-shaped random model with LoRA r=16 on all linears, fp32, gradient
# checkpointing, the naive log-prob head, AdamW. A first 4-token step creates the Adam states (as in every step
# after the first); the peak RSS over the process minus the RSS right after the imports is compared. The lengths
# run in one process, shortest first: each step's peak is above the ones before it, so the process's peak after it
# is its own (one process instead of three: ~30 s of imports and model builds less in CI).
# MALLOC_MMAP_THRESHOLD_ makes glibc return freed blocks to the OS so RSS follows live bytes (the analogue of
# torch.cuda.max_memory_allocated); with glibc's default, retained heap adds ~40% on top (allocator behaviour).
STEP_SCRIPT = r"""
import json, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from grpo_accel.planning.architectures import get_architecture
from grpo_accel.core.phase_memory import peak_rss_bytes, rss_bytes

B, P, *lengths = map(int, sys.argv[1:])
torch.manual_seed(0)
base = rss_bytes()
model = AutoModelForCausalLM.from_config(get_architecture("smollm2-135m"))
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

def step(t):
    ids = torch.randint(0, model.config.vocab_size, (B, P + t))
    logits = model(input_ids=ids, logits_to_keep=t + 1).logits[:, :-1]
    logp = logits.float().log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    del logits
    (-logp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

step(4)
peaks = []
for T in sorted(lengths):
    step(T)
    peaks.append(peak_rss_bytes() - base)
print(json.dumps(peaks))
"""


def _measure(batch, prompt, completions):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(batch), str(prompt), *map(str, completions)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.long
def test_planner_matches_measured_cpu_step():
    B, P = 2, 16
    rows = []
    lengths = (64, 128, 256)
    for T, measured in zip(lengths, _measure(B, P, lengths)):
        predicted = plan_memory("smollm2-135m", model_dtype="fp32", lora_r=16, per_device_train_batch_size=B,
                                max_prompt_length=P,
                                max_completion_length=T, gradient_checkpointing=True, logprob_impl="naive",
                                device="cpu").peak_bytes
        rows.append((T, measured, predicted))
    print("\ncompletion  measured MiB  predicted MiB  error")
    for T, m, p in rows:
        print(f"{T:>10}  {m / MIB:>12.1f}  {p / MIB:>13.1f}  {(p - m) / m:+.1%}")
    for T, m, p in rows:
        assert abs(p - m) / m < 0.15, (T, m / MIB, p / MIB)
    # the length-dependent part (activations + logits), not only the weights, is predicted
    grow_measured, grow_predicted = rows[-1][1] - rows[0][1], rows[-1][2] - rows[0][2]
    print(f"growth 64->256: measured {grow_measured / MIB:.1f} MiB, predicted {grow_predicted / MIB:.1f} MiB")
    assert abs(grow_predicted - grow_measured) / grow_measured < 0.25


def test_architectures_table_is_complete():
    assert set(PUBLISHED_PARAMS) <= set(ARCHITECTURES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt-oss", "tiny-qwen3-moe"])
def test_mlp_saved_bytes_match_autograd(name, dtype):
    """What one layer's MLP block keeps for backward (autograd's saved tensors, once per storage, parameters and the
    input excluded) is the planner's mlp_saved_bytes_per_token, byte for byte: the dense MLP and each MoE family's
    expert loop (router, sorted dispatch, GLU), so a transformers upgrade that changes what they save fails here."""
    from grpo_accel.data.models import build_tiny_model, load_tokenizer
    from grpo_accel.offload.tracker import SavedActivationTracker
    from grpo_accel.planning.activations import mlp_saved_bytes_per_token

    model = build_tiny_model(name, load_tokenizer("tiny-llama")).to(dtype)
    T = 1024
    x = torch.randn(1, T, model.config.hidden_size, dtype=dtype, requires_grad=True)
    tracker = SavedActivationTracker(observe_autograd=True, ignore=[*model.parameters(), x], device="cpu")
    with tracker:
        model.model.layers[0].mlp(x)
    a = torch.finfo(dtype).bits // 8
    assert tracker.peak["device"] / T == pytest.approx(mlp_saved_bytes_per_token(model_shape(name), a), abs=0.05)


def _cpu_peak_bytes(fn) -> int:
    """The most bytes torch held at once on CPU while `fn` ran, above what it held before (the profiler's
    allocation events, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start):
        held += event.cpu_memory_usage
        peak = max(peak, held)
    return peak


def _step(module, x):
    module(x).backward(torch.ones_like(x))


# How far over the measured peak the plan's expert-adapter term may be: the CPUs' spread (docstring below), never under.
EXPERT_PEAK_MARGIN = 1.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_adapters_cost_what_the_planner_says(dtype):
    """PEFT's LoRA on Qwen3-MoE's 3-D experts builds each layer's adapted weights whole in every forward: what the
    forward saves beyond the frozen-expert layer equals the planner's (autograd's saved tensors, byte for byte), and
    the forward + backward peak beyond it is never above the planner's and at most EXPERT_PEAK_MARGIN below it (the
    adapters' own .grad tensors aside: the planner counts those in "gradients"), at 256 and 2048 tokens alike: a
    per-layer cost, not a per-token one.

    Why a one-sided bound: the peak's transients around the bf16 expert GEMMs differ by CPU. Per expert weight,
    fp32: 11.8 bytes on an AVX-512 Xeon and an AVX2 EPYC alike; bf16: 11.5 on the Xeon (AVX512-BF16/AMX bf16 GEMM
    kernels) and 10.8 on the AVX2-only EPYC (no bf16 dot product in hardware: other kernels; which of their
    temporaries differs was not isolated, and no cap on the Xeon reproduces the EPYC's figure). The plan
    (EXPERT_ADAPTER_PEAK_BYTES = 12) keeps the largest, as a plan must; the margin is the spread seen between CPUs,
    not one machine's figure: 12 / 10.8 = 1.11, under 1.15."""
    from peft import LoraConfig, get_peft_model

    from grpo_accel.data.models import build_tiny_model, load_tokenizer
    from grpo_accel.offload.tracker import SavedActivationTracker
    from grpo_accel.planning.activations import expert_adapter_bytes

    a = torch.finfo(dtype).bits // 8
    shape = model_shape("tiny-qwen3-moe")
    planned_saved, planned_peak = expert_adapter_bytes(shape, a, lora_r=4)
    measured = {}
    for lora in (False, True):
        torch.manual_seed(0)
        model = build_tiny_model("tiny-qwen3-moe", load_tokenizer("tiny-llama")).to(dtype)
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).base_model.model
        mlp = model.model.layers[0].mlp
        adapter_grads = sum(p.numel() * 4 for n, p in mlp.named_parameters() if p.requires_grad and "lora_" in n)
        for T in (256, 2048):
            x = torch.randn(1, T, shape.hidden, dtype=dtype, requires_grad=True)
            tracker = SavedActivationTracker(observe_autograd=True, ignore=[*model.parameters(), x], device="cpu")
            with tracker:
                out = mlp(x)
            out.backward(torch.ones_like(out))  # warm: the peak below is one step's, not the first allocations'
            step_peak = _cpu_peak_bytes(functools.partial(_step, mlp, x))
            measured[lora, T] = tracker.peak["device"], step_peak - adapter_grads
    assert planned_saved > 0
    for T in (256, 2048):
        saved = measured[True, T][0] - measured[False, T][0]
        peak = measured[True, T][1] - measured[False, T][1]
        assert saved == planned_saved, (T, saved, planned_saved)
        assert peak <= planned_peak <= peak * EXPERT_PEAK_MARGIN, (T, peak, planned_peak, peak / planned_peak)
    # what a plan then carries: Qwen3-30B-A3B's 48 layers of 128 experts, LoRA r=16, bf16, checkpointed: the
    # re-run of one layer holds its adapted experts' peak
    big = model_shape("qwen3-30b-a3b")
    kw = dict(model_dtype="bf16", lora_r=16, per_device_train_batch_size=1, max_completion_length=4096)
    base = plan_memory(big, **kw).device["recompute_working_set"]
    assert base - plan_memory(dataclasses.replace(big, lora_experts=False), **kw).device["recompute_working_set"] == \
        expert_adapter_bytes(big, 2, 16)[1] > 6 * GIB


@pytest.mark.parametrize("name", ["h100_110k", "a100_80gb_bf16"])
def test_generation_phase_is_the_training_side_plus_the_engines_whole_budget(name):
    """While a colocated engine generates, the device holds the training side's resident bytes (the trainer's own
    weights, adapter, optimizer states: no training transients) and the engine's whole gpu_memory_utilization budget
    (vLLM gives its KV cache all the budget its weights and runtime leave); shared weights are counted once, inside
    the engine's budget. The run's fraction leaves the training side its room, so the phase fits the GPU."""
    from grpo_accel.app.presets import get_preset
    from grpo_accel.planning.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION

    plan, gpu = get_preset(name).plan(), int(79.1 * GIB)
    d = plan.device
    budget = vllm_memory_fraction(plan, gpu) * gpu
    trainer_own = 0 if plan.route == "vllm_shared" else d["weights"]
    resident = trainer_own + d["lora_weights"] + d["optimizer_states"] + d["reward_models"]
    expected = resident + budget + CUDA_CONTEXT_BYTES + FRAGMENTATION * resident
    assert plan.generation_bytes(gpu) == pytest.approx(expected, abs=4)
    assert plan.generation_bytes(gpu, optimizer_states=False) == pytest.approx(
        expected - 1.05 * d["optimizer_states"], abs=4)
    assert plan.generation_bytes(gpu) <= gpu
    # the engine's KV cache is more than the plan's whole sequences, less than one sequence more
    per_seq = plan.device["vllm_kv_cache"]  # the plan's KV term holds one full-length sequence (vllm_kv_seqs=1)
    seqs = kv_cache_sequences(plan, gpu)
    assert seqs * per_seq <= engine_kv_bytes(plan, gpu) < (seqs + 1) * per_seq
