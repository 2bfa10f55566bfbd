"""The shared-weight engine's checks (generation/share_check.py) without an engine: runs in the main venv.

The checkpoint check against transformers' own loader (a model it loads from the checkpoint passes, in the
checkpoint's dtype and cast to bf16) and against the wrong shares a layout bug makes (transposed, shifted within a
fused tensor, another layer's): each is refused naming the parameter. The agreement bound's wider computation against
a model transformers converted to that dtype. The engine itself: tests/vllm_engine/test_vllm_colocate.py.
"""

import pytest
import torch

from grpo_accel.data.models import build_tiny_model, load_tokenizer
from grpo_accel.generation import share_check as sc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = load_tokenizer("tiny-llama")
    model = build_tiny_model("tiny-llama", tokenizer, initializer_range=0.2)
    target = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(target)
    return str(target)


def _load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_transformers_loads_from_the_checkpoint_matches_it(checkpoint, dtype):
    """fp32 checkpoint: as loaded, and cast to bf16 as the engine and transformers both cast it (round to nearest)."""
    assert sc.checkpoint_mismatch(_load(checkpoint, dtype), checkpoint) is None


def _fused_qkv(model, layer: int = 0) -> tuple[torch.Tensor, list[int]]:
    attn = model.model.layers[layer].self_attn
    parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    return torch.cat([p.detach() for p in parts]), [p.shape[0] for p in parts]


def _share(linear, view: torch.Tensor) -> None:
    linear._parameters["weight"] = torch.nn.Parameter(view, requires_grad=False)


def _wrong_share(model, kind: str) -> str:
    """Put one wrong view in place, as a layout bug in vllm_colocate.engine_views would; the parameter's name."""
    layers = model.model.layers
    if kind == "transposed":  # a square weight read in the other orientation
        _share(layers[0].self_attn.o_proj, layers[0].self_attn.o_proj.weight.detach().t())
        return "model.layers.0.self_attn.o_proj.weight"
    if kind == "shifted":  # k cut one row too late from the engine's fused qkv tensor
        fused, rows = _fused_qkv(model)
        _share(layers[0].self_attn.k_proj, fused[rows[0] + 1: rows[0] + 1 + rows[1]])
        return "model.layers.0.self_attn.k_proj.weight"
    if kind == "other_layer":  # layer 1's tensor where layer 0's belongs
        _share(layers[0].mlp.down_proj, layers[1].mlp.down_proj.weight.detach())
        return "model.layers.0.mlp.down_proj.weight"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["transposed", "shifted", "other_layer"])
def test_each_wrong_share_is_refused_naming_the_parameter(checkpoint, kind):
    model = _load(checkpoint)
    name = _wrong_share(model, kind)
    reason = sc.checkpoint_mismatch(model, checkpoint)
    assert reason is not None and reason.startswith(name), reason


def test_a_share_right_but_for_one_value_is_refused(checkpoint):
    """Bit for bit: one value one bf16 step off (what a dtype round trip or an in-place rewrite leaves) is refused."""
    model = _load(checkpoint, torch.bfloat16)
    w = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        w.view(-1)[7] += w.view(-1)[7].abs() * 2 ** -6  # a couple of bf16 steps (8 bits of mantissa)
    reason = sc.checkpoint_mismatch(model, checkpoint)
    assert reason is not None and "model.layers.1.mlp.up_proj.weight" in reason and "1 of" in reason, reason


def test_a_parameter_the_checkpoint_lacks_is_not_taken_on_trust(checkpoint):
    model = _load(checkpoint)
    model.model.layers[0].self_attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    reason = sc.checkpoint_mismatch(model, checkpoint)
    assert reason is not None and "not in the checkpoint" in reason and "self_attn.extra" in reason


def test_a_wider_computation_is_the_model_converted_to_that_dtype(checkpoint):
    """computed_in(model, fp32) on a bf16 model gives what transformers' own fp32 conversion of it gives, bit for bit,
    and leaves the model's own tensors (the engine's, when shared) as they were, also when its forward raises."""
    model = _load(checkpoint, torch.bfloat16)
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    converted = _load(checkpoint, torch.bfloat16).to(torch.float32)
    ids = list(range(5, 40))
    got = sc.token_logprobs(model, ids, torch.float32)
    assert torch.equal(got, sc.token_logprobs(converted, ids))
    assert not torch.equal(got, sc.token_logprobs(model, ids))  # it did compute in fp32
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
    with pytest.raises(IndexError), sc.computed_in(model, torch.float32):
        model(input_ids=torch.tensor([[10**7]]))
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before


def test_the_agreement_bound_comes_from_the_models_own_rounding(checkpoint):
    """An engine that computes the same function (here: the fp32 model, exact up to bf16's rounding of HF) is within
    the bound; one whose last layer differs is not. The bound scales with the dtype: fp32's is far below bf16's."""
    ids = list(range(5, 40))
    bf16, fp32 = _load(checkpoint, torch.bfloat16), _load(checkpoint)
    same = sc.agreement(bf16, ids, sc.token_logprobs(fp32, ids), torch.bfloat16)
    assert same.ok and same.hf_rounding > 0 and same.bound == sc.AGREEMENT_MARGIN * same.hf_rounding
    other = _load(checkpoint)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(-1)
    assert not sc.agreement(bf16, ids, sc.token_logprobs(other, ids), torch.bfloat16).ok
    exact = sc.agreement(fp32, ids, sc.token_logprobs(fp32, ids), torch.float32)
    assert exact.ok and exact.bound < same.bound / 100
