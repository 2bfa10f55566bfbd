"""The tiled-MLP runs (test_tiled_mlp.py, test_moe.py): a model's output, d(input embeddings) and every gradient on
rows of unequal length with left padding, under random output weights; TOKENS per tile."""

import torch

TOKENS = 5


def batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 200, (3, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding, as TRL batches prompts
    mask[2, :17] = 0
    return ids, mask


def run(model):
    ids, mask = batch()
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, attention_mask=mask).logits
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), emb.grad, grads
