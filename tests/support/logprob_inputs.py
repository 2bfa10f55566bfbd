"""The log-prob kernels' inputs and runs (test_logprobs.py, test_logprobs_triton.py): seeded hidden states, head
weights and targets, forward + backward with random output grads, and the fp64 reference run."""

import torch

from grpo_accel.ops.logprobs import logprobs_reference

N, H, V = 37, 24, 101  # odd on purpose: no tile divides V


def make_inputs(n=N, h=H, v=V, dtype=torch.float32, seed=0, mask_every=5, scale=1.5):
    """Logits with std ~ scale * sqrt(H) ~ 7: softcap 5 bends them, temperature 0.7 sharpens them."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    if mask_every:
        targets[::mask_every] = -100
    return hidden, weight, targets


def run(fn, hidden, weight, targets, g_lp, g_ent, **kw):
    """Forward + backward with random output grads; returns (logp, entropy, d hidden, d weight)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, targets, **kw)
    loss = (logp * g_lp.to(logp.dtype)).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    loss.backward()
    return logp, ent, h.grad, w.grad


def reference64(hidden, weight, targets, g_lp, g_ent, temperature=1.0, softcap=None):
    def ref(h, w, t, **_):
        return logprobs_reference(h, w, t, temperature, softcap)

    return run(ref, hidden.double(), weight.double(), targets, g_lp.double(),
               None if g_ent is None else g_ent.double())


def grads_out(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)
