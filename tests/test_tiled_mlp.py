"""The sequence-tiled MLP (grpo_accel/tiling/mlp.py) is the same function as the whole MLP: a tiny-llama's
output and every gradient (inputs, LoRA or full weights) equal the untiled model's in fp32 (<= 1e-5 relative) on rows
of unequal length with left padding; with LoRA dropout live, backward replays each tile's forward masks (checked
against plain autograd over the same tiles drawn from the same seed); and the MLP's saved tensors fall to its input."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from support.compare import assert_rel_close, rel_norm
from support.mlp_model import TOKENS, run

from grpo_accel.data.models import load_model
from grpo_accel.tiling import mlp as tiled_mlp


def build(peft: bool, dropout: float = 0.0):
    torch.manual_seed(0)
    model, _ = load_model("tiny-llama")
    if peft:
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                          target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
        model = get_peft_model(model, lora)
        with torch.no_grad():  # lora_B starts at 0 (lora_A's grads would be 0)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model.train()


@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_tiled_mlp_equals_whole(peft):
    ref = run(build(peft))
    model = build(peft)
    assert tiled_mlp.install(model, TOKENS) == 2  # tiny-llama's two decoder layers
    out, d_emb, grads = run(model)
    assert rel_norm(out, ref[0]) <= 1e-5 and rel_norm(d_emb, ref[1]) <= 1e-5
    assert grads.keys() == ref[2].keys() and len(grads) > 4
    assert_rel_close(ref[2], grads, 1e-5, nonzero=True)


def test_tiled_mlp_replays_dropout_masks():
    """LoRA dropout live: the tiled MLP's gradients equal plain autograd over the same tiles from the same seed;
    a backward that drew fresh masks would not (the masks differ per draw)."""
    layer = build(True, dropout=0.3).base_model.model.model.layers[0]
    x = torch.randn(2, 17, layer.mlp.gate_proj.in_features)
    g = torch.randn(2, 17, layer.mlp.down_proj.out_features)
    tiles = [slice(s, min(s + TOKENS, 17)) for s in range(0, 17, TOKENS)]
    params = [p for p in layer.mlp.parameters() if p.requires_grad]

    def grads(call):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        xg = x.clone().requires_grad_(True)
        call(xg).backward(g)
        return [xg.grad] + [p.grad.clone() for p in params]

    ref = grads(lambda xg: torch.cat([layer.mlp(xg[:, sl]) for sl in tiles], 1))
    assert tiled_mlp.install(layer, TOKENS) == 1
    got = grads(layer.mlp)
    for a, b in zip(got, ref):
        assert rel_norm(a, b) <= 1e-5
    other = grads(lambda xg: torch.cat([layer.mlp(xg[:, sl]) for sl in tiles[::-1]][::-1], 1))
    assert rel_norm(other[0], ref[0]) > 1e-2  # other draws, other masks: the check above can fail


def test_tiled_mlp_saves_only_its_input():
    layer = build(False).model.layers[0]
    x = torch.randn(1, 40, layer.mlp.gate_proj.in_features, requires_grad=True)

    def saved_bytes():
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size() if t.data_ptr() != x.data_ptr() else 0)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer.mlp(x)
        y.sum().backward()
        return sum(total)

    whole = saved_bytes()
    tiled_mlp.install(layer, TOKENS)
    tiled = saved_bytes()
    intermediate = layer.mlp.gate_proj.out_features * 40 * 4
    assert whole >= 4 * intermediate and tiled == 0  # x itself is the only tensor the tiled MLP keeps
