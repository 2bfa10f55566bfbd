"""Fused log-prob head (torch paths) vs the fp64 reference: values, gradients, dtypes, masking, memory.

OMP_NUM_THREADS=1 pytest tests/test_logprobs.py -q
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from support.compare import rel_max
from support.logprob_inputs import H, N, V, grads_out, make_inputs, reference64, run
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_accel.ops.logprobs import chunked_logprobs, logprobs_reference, plan_blocks
from grpo_accel.ops.select import token_logprobs


def test_reference_matches_torch_builtins():
    hidden, weight, targets = make_inputs(dtype=torch.float64)
    valid = targets != -100
    logits = hidden @ weight.T
    logp, ent = logprobs_reference(hidden, weight, targets)
    ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    torch.testing.assert_close(logp, -ce, rtol=0, atol=1e-12)
    cat = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(ent[valid], cat[valid], rtol=0, atol=1e-12)
    assert (ent[~valid] == 0).all() and (logp[~valid] == 0).all()
    # HF order: softcap first, then temperature
    logp2, ent2 = logprobs_reference(hidden, weight, targets, temperature=0.7, softcap=5.0)
    z = 5.0 * torch.tanh(logits / 5.0) / 0.7
    torch.testing.assert_close(logp2, -F.cross_entropy(z, targets, reduction="none"), rtol=0, atol=1e-12)
    torch.testing.assert_close(ent2[valid], torch.distributions.Categorical(logits=z).entropy()[valid])


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.0, 5.0), (0.7, 5.0)])
@pytest.mark.parametrize("chunk_size,vocab_tile", [(None, None), (8, 16), (5, 7), (37, 101)])
def test_chunked_fp32_matches_fp64_reference(temperature, softcap, chunk_size, vocab_tile):
    hidden, weight, targets = make_inputs()
    g_lp, g_ent = grads_out()
    kw = dict(temperature=temperature, softcap=softcap, compute_entropy=True, chunk_size=chunk_size,
              vocab_tile=vocab_tile)
    logp, ent, dh, dw = run(chunked_logprobs, hidden, weight, targets, g_lp, g_ent, **kw)
    rl, re, rdh, rdw = reference64(hidden, weight, targets, g_lp, g_ent, temperature, softcap)
    assert logp.dtype == ent.dtype == torch.float32 and dh.dtype == dw.dtype == torch.float32
    for ours, ref in ((logp, rl), (ent, re), (dh, rdh), (dw, rdw)):
        assert rel_max(ours, ref) < 1e-5
    assert (logp[targets == -100] == 0).all() and (ent[targets == -100] == 0).all()
    assert (dh[targets == -100] == 0).all()


@pytest.mark.parametrize("use_logp,use_ent", [(True, False), (False, True)])
def test_partial_output_grads(use_logp, use_ent):
    """Only logp used (entropy logged, no grad), or only entropy used: backward skips the absent term."""
    hidden, weight, targets = make_inputs()
    g_lp, g_ent = grads_out()
    g_lp = g_lp if use_logp else torch.zeros(N)
    g_ent = g_ent if use_ent else torch.zeros(N)

    def loss_of(fn, h, w):
        logp, ent = fn(h, w, targets, temperature=0.7, softcap=5.0, compute_entropy=True)
        return (logp * g_lp.to(logp.dtype)).sum() if use_logp else (ent * g_ent.to(ent.dtype)).sum()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_of(chunked_logprobs, h, w).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss_of(lambda *a, **k: logprobs_reference(*a[:3], k["temperature"], k["softcap"]), h64, w64).backward()
    assert rel_max(h.grad, h64.grad) < 1e-5 and rel_max(w.grad, w64.grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_no_worse_than_plain_torch(dtype):
    """Error vs fp64 (on the same rounded inputs) at most 2x that of the plain torch path in the same dtype."""
    hidden, weight, targets = make_inputs(dtype=dtype)
    g_lp, g_ent = grads_out()
    kw = dict(temperature=0.7, softcap=5.0)
    ours = run(chunked_logprobs, hidden, weight, targets, g_lp, g_ent, compute_entropy=True, chunk_size=16,
               vocab_tile=32, **kw)

    def plain(h, w, t, temperature, softcap):  # what a model + TRL's naive path does in this dtype
        logits = (h @ w.T).float()
        logits = softcap * torch.tanh(logits / softcap)
        logp_all = (logits / temperature).log_softmax(-1)
        valid = t != -100
        lp = logp_all.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1).masked_fill(~valid, 0)
        return lp, (-(logp_all.exp() * logp_all).sum(-1)).masked_fill(~valid, 0)

    torch_path = run(plain, hidden, weight, targets, g_lp, g_ent, **kw)
    ref = reference64(hidden, weight, targets, g_lp, g_ent, **kw)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == ours[3].dtype == dtype
    for name, o, p, r in zip(("logp", "entropy", "d hidden", "d weight"), ours, torch_path, ref):
        assert rel_max(o, r) <= 2 * rel_max(p, r) + 1e-6, name


def test_mixed_dtypes_and_autocast():
    """bf16 hidden + fp32 weight: fp32 GEMMs, each grad in its input's dtype. Under autocast (bf16), the GEMM
    operands are rounded to bf16 as TRL does: identical to passing bf16 copies of the inputs."""
    hidden, weight, targets = make_inputs()
    g_lp, g_ent = grads_out()
    ours = run(chunked_logprobs, hidden.bfloat16(), weight, targets, g_lp, g_ent, compute_entropy=True)
    ref = reference64(hidden.bfloat16(), weight, targets, g_lp, g_ent)
    assert ours[2].dtype == torch.bfloat16 and ours[3].dtype == torch.float32
    assert rel_max(ours[0], ref[0]) < 1e-5 and rel_max(ours[3], ref[3]) < 1e-5

    def autocast_fn(*a, **k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunked_logprobs(*a, **k)

    auto = run(autocast_fn, hidden, weight, targets, g_lp, g_ent, compute_entropy=True)
    cast = run(chunked_logprobs, hidden.bfloat16(), weight.bfloat16(), targets, g_lp, g_ent, compute_entropy=True)
    assert auto[2].dtype == auto[3].dtype == torch.float32
    for a, c in zip(auto, cast):
        torch.testing.assert_close(a, c.float(), rtol=1e-2, atol=1e-6)
    assert torch.equal(auto[0], cast[0])


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_non_contiguous_hidden(layout):
    hidden, weight, targets = make_inputs()
    if layout == "transposed":
        base = hidden.T.contiguous().requires_grad_()  # [H, N]; base.T is [N, H] with strides (1, N)
        view_of = lambda b: b.T  # noqa: E731
    else:
        base = torch.zeros(2 * N, H + 3)
        base[::2, 1 : H + 1] = hidden
        base.requires_grad_()
        view_of = lambda b: b[::2, 1 : H + 1]  # noqa: E731
    view = view_of(base)
    assert not view.is_contiguous() and torch.equal(view, hidden)
    g_lp, g_ent = grads_out()
    w = weight.clone().requires_grad_()
    logp, ent = chunked_logprobs(view, w, targets, temperature=0.7, compute_entropy=True, chunk_size=8,
                                 vocab_tile=16)
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    rl, re, rdh, rdw = reference64(hidden, weight, targets, g_lp, g_ent, 0.7)
    for ours, ref in ((logp, rl), (ent, re), (view_of(base.grad), rdh), (w.grad, rdw)):
        assert rel_max(ours, ref) < 1e-5


def test_gradcheck_fp64():
    hidden, weight, targets = make_inputs(n=6, h=5, v=11, dtype=torch.float64, mask_every=4)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def f(h, w):
        return chunked_logprobs(h, w, targets, temperature=0.7, softcap=5.0, compute_entropy=True,
                                chunk_size=4, vocab_tile=3)

    assert torch.autograd.gradcheck(f, (h, w))


def test_tied_embeddings_accumulate_both_grads():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H)
    proj = torch.randn(H, H) / H**0.5
    ids = torch.randint(0, V, (N,))
    targets = torch.roll(ids, -1)
    grads = {}
    for name, fn in (("ours", chunked_logprobs), ("ref", lambda h, w, t: logprobs_reference(h, w, t))):
        emb.weight.grad = None
        hidden = torch.tanh(emb(ids) @ proj) * 3
        logp, _ = fn(hidden, emb.weight, targets)
        logp.sum().backward()
        grads[name] = emb.weight.grad.clone()
    assert rel_max(grads["ours"], grads["ref"]) < 1e-5


def test_weight_ctx_wraps_the_backward_recompute():
    """weight_ctx (ZeRO-3: re-gather the head for the recompute) is entered once, around the backward only."""
    import contextlib

    hidden, weight, targets = make_inputs()
    events = []

    @contextlib.contextmanager
    def ctx():
        events.append("enter")
        yield
        events.append("exit")

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = token_logprobs(h, w, targets, impl="chunked", weight_ctx=ctx)
    assert events == []
    logp.sum().backward()
    assert events == ["enter", "exit"]
    h64 = hidden.double().requires_grad_()
    logprobs_reference(h64, weight.double(), targets)[0].sum().backward()
    assert rel_max(h.grad, h64.grad) < 1e-5


def test_frozen_weight_only_hidden_grad():
    hidden, weight, targets = make_inputs()
    h = hidden.clone().requires_grad_()
    logp, _ = chunked_logprobs(h, weight, targets, softcap=5.0)
    logp.sum().backward()
    h64 = hidden.double().requires_grad_()
    logprobs_reference(h64, weight.double(), targets, softcap=5.0)[0].sum().backward()
    assert weight.grad is None and rel_max(h.grad, h64.grad) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["chunked", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_one_chunk_and_many_vs_fp64(impl, dtype):
    """CUDA, half inputs: one token chunk writes d(weight) straight in the half dtype, several chunks accumulate in
    fp32; both within 2x plain torch's error vs fp64. V=5000 is no multiple of 128 (a misaligned last tile)."""
    if impl == "triton":
        pytest.importorskip("triton")
    n, h, v = 1000, 256, 5000
    hidden, weight, targets = (x.cuda() for x in make_inputs(n, h, v, dtype=dtype, seed=3, scale=0.3))
    g_lp, g_ent = (x.cuda() for x in grads_out(n, seed=4))
    kw = dict(temperature=0.7, softcap=None)
    ref = reference64(hidden, weight, targets, g_lp, g_ent, **kw)

    def plain(hh, w, t, temperature, softcap):
        logp_all = ((hh @ w.T).float() / temperature).log_softmax(-1)
        valid = t != -100
        lp = logp_all.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1).masked_fill(~valid, 0)
        return lp, (-(logp_all.exp() * logp_all).sum(-1)).masked_fill(~valid, 0)

    torch_path = run(plain, hidden, weight, targets, g_lp, g_ent, **kw)
    for chunk_size in (None, 128):  # None: every row in one chunk (direct d(weight)); 128: 7 chunks
        ours = run(lambda *a, **k: token_logprobs(*a, impl=impl, **k), hidden, weight, targets, g_lp, g_ent,
                   compute_entropy=True, chunk_size=chunk_size, **kw)
        assert ours[2].dtype == ours[3].dtype == dtype
        for name, o, p, r in zip(("logp", "entropy", "d hidden", "d weight"), ours, torch_path, ref):
            assert rel_max(o, r) <= 2 * rel_max(p, r) + 1e-6, (name, chunk_size)


def test_all_tokens_masked():
    hidden, weight, _ = make_inputs()
    targets = torch.full((N,), -100)
    h = hidden.clone().requires_grad_()
    logp, ent = chunked_logprobs(h, weight, targets, compute_entropy=True)
    assert (logp == 0).all() and (ent == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert h.grad is None or (h.grad == 0).all()


def test_errors_name_the_fix():
    hidden, weight, targets = make_inputs()
    with pytest.raises(ValueError, match=r"\[0, 101\)"):
        chunked_logprobs(hidden, weight, targets.clamp(min=0) + V)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="'chunked'"):
        token_logprobs(hidden, weight, targets, impl="fast")


def test_triton_import_error_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    monkeypatch.delitem(sys.modules, "grpo_accel.ops.logprobs_triton", raising=False)
    hidden, weight, targets = make_inputs()
    with pytest.raises(ImportError, match="impl='chunked'"):
        token_logprobs(hidden, weight, targets, impl="triton")


def test_dispatcher_leading_dims_and_impls():
    hidden, weight, targets = make_inputs(n=2 * 18)
    h3, t3 = hidden.view(2, 18, H), targets.view(2, 18)
    out = {impl: token_logprobs(h3, weight, t3, impl=impl, temperature=0.7, compute_entropy=True)
           for impl in ("auto", "chunked", "reference")}
    assert out["auto"][0].shape == (2, 18) and out["auto"][1].shape == (2, 18)
    assert torch.equal(out["auto"][0], out["chunked"][0])  # auto is chunked on CPU
    assert rel_max(out["chunked"][0], out["reference"][0]) < 1e-5
    assert token_logprobs(h3, weight, t3)[1] is None


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates (the honest 'no [N, V] tensor' check)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_full_logits():
    n, h, v, chunk, tile = 256, 16, 1000, 32, 64
    hidden, weight, targets = make_inputs(n=n, h=h, v=v)
    for fn, bound in ((lambda *a: chunked_logprobs(*a, softcap=5.0, compute_entropy=True, chunk_size=chunk,
                                                    vocab_tile=tile),
                       max(3 * chunk * tile, v * h)),  # 3 blocks (softcap + entropy grad) or d weight
                      (lambda *a: logprobs_reference(*a), None)):
        hh, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _LargestTensor() as probe:
            logp, ent = fn(hh, w, targets)
            (logp.sum() + ent.sum()).backward()
        if bound is None:
            assert probe.largest >= n * v  # the probe does see an [N, V] tensor when there is one
        else:
            assert probe.largest <= bound < n * v


def test_plan_blocks_respects_budget_and_overrides():
    chunk, tile = plan_blocks(16384, 49152, "cpu", bytes_per_elem=8)
    assert chunk * tile * 8 <= 32 << 20 and chunk % 16 == 0 and tile <= 49152
    assert plan_blocks(16384, 49152, "cpu", 8, chunk_size=100, vocab_tile=7) == (100, 7)
    chunk, tile = plan_blocks(37, 151936, "cpu", bytes_per_elem=4)  # few rows: widen the tile instead
    assert chunk == 37 and tile > 4096 and chunk * tile * 4 <= 32 << 20
