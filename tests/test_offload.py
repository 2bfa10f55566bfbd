"""Activation offload: gradients bit-identical to plain (checkpointed) training, and saved bytes move
off the device. CPU tier forces the real stash/copy/restore path with
OffloadConfig(device_copies=True, use_streams=False, pin_memory=False).

    OMP_NUM_THREADS=1 pytest tests/test_offload.py -q
"""

import functools
from pathlib import Path

import pytest
import torch
import transformers
from support.compare import assert_equal
from support.offload_model import FORCED, LAYER_BYTES, B, H, T, V, tiny_llama

from grpo_accel.offload import (
    OffloadConfig,
    OffloadedCheckpoint,
    SavedActivationTracker,
    install_activation_offload,
    offload_saved_tensors,
    offloaded_checkpoint,
    remove_activation_offload,
)


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def run_step(model, mode, ids):
    """mode: 'plain' (no checkpointing), 'torch' (transformers' checkpointing), 'offload' (ours, forced)."""
    if mode == "torch":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "offload":
        install_activation_offload(model, FORCED)
    torch.manual_seed(1234)  # same dropout masks for every mode
    with SavedActivationTracker() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, tracker


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_full_finetune_grads_bit_identical(dropout):
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    loss_ref, ref, _ = run_step(tiny_llama(dropout=dropout), "plain", ids)
    for mode in ("torch", "offload"):
        loss, grads, tracker = run_step(tiny_llama(dropout=dropout), mode, ids)
        assert torch.equal(loss, loss_ref)
        assert_equal(ref, grads)
        if mode == "offload":  # the copies really happened, and all were freed
            assert tracker.peak["host"] == 3 * LAYER_BYTES and tracker.bytes == {"device": 0, "host": 0}
    assert len(ref) == len(list(tiny_llama().parameters()))
    if dropout:  # dropout is live, so the match above needed the RNG replay
        loss_nodrop, _, _ = run_step(tiny_llama(dropout=0.0), "plain", ids)
        assert not torch.equal(loss_nodrop, loss_ref)


def test_dropout_without_rng_replay_differs():
    """Control for the test above: recomputing with fresh dropout masks changes the gradients."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    _, ref, _ = run_step(tiny_llama(dropout=0.2), "plain", ids)
    model = tiny_llama(dropout=0.2)
    no_replay = functools.partial(OffloadedCheckpoint(FORCED), preserve_rng_state=False)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=no_replay)
    _, grads, _ = run_step(model, "plain", ids)
    assert any(not torch.equal(ref[n], grads[n]) for n in ref)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lora_grads_bit_identical_and_install_is_sticky():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    _, ref, _ = run_step(lora(tiny_llama(dropout=0.1)), "plain", ids)
    assert ref and all("lora_" in n for n in ref)  # frozen base: only adapter grads
    assert all(g.abs().sum() > 0 for n, g in ref.items() if "lora_B" in n)
    _, grads_torch, _ = run_step(lora(tiny_llama(dropout=0.1)), "torch", ids)
    assert_equal(ref, grads_torch)

    model = lora(tiny_llama(dropout=0.1))
    ckpt = install_activation_offload(model, FORCED)
    emb = model.get_base_model().model.embed_tokens
    assert not emb(ids).requires_grad  # no enable_input_require_grads: the layers' dummy input carries grads
    _, grads, tracker = run_step(model, "plain", ids)
    assert_equal(ref, grads)
    assert tracker.peak["host"] > 0

    layers = model.get_base_model().model.layers
    model.gradient_checkpointing_enable()  # what Trainer / TRL's generation unwrap call later
    assert all(layer.gradient_checkpointing and layer._gradient_checkpointing_func is ckpt for layer in layers)
    model.zero_grad(set_to_none=True)
    _, grads, _ = run_step(model, "plain", ids)
    assert_equal(ref, grads)
    assert remove_activation_offload(model) and not remove_activation_offload(model)
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert all("_gradient_checkpointing_func" not in layer.__dict__ for layer in layers)


def test_device_resident_bytes_one_layer_with_offload_all_layers_without():
    L = 6
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for name, cfg in (("on", FORCED), ("off", OffloadConfig(device_copies=False, min_bytes=0))):
        model = tiny_llama(layers=L)
        install_activation_offload(model, cfg)
        with SavedActivationTracker() as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            fwd = dict(tracker.peak)
            tracker.reset_peak()
            loss.backward()
            peaks[name] = (fwd, dict(tracker.peak))
        assert tracker.bytes == {"device": 0, "host": 0}
    (on_fwd, on_bwd), (off_fwd, off_bwd) = peaks["on"], peaks["off"]
    assert on_fwd == {"device": LAYER_BYTES, "host": (L - 1) * LAYER_BYTES}  # the last layer's input stays
    assert on_bwd["device"] == 2 * LAYER_BYTES  # double buffer: this layer + the prefetched previous one
    assert off_fwd == {"device": L * LAYER_BYTES, "host": 0}
    assert off_bwd["device"] == L * LAYER_BYTES


def test_observed_saved_bytes_match_torch_reentrant_checkpoint():
    """Independent of the stash's own reports: autograd's saved tensors under torch's reentrant
    checkpoint exceed ours (stash on, forced copies) by exactly the L-1 offloaded layer inputs."""
    L = 5
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    peaks = {}
    for name in ("torch", "ours", "none"):
        model = tiny_llama(layers=L)
        if name == "torch":
            model._set_gradient_checkpointing(True, functools.partial(torch.utils.checkpoint.checkpoint,
                                                                      use_reentrant=True))
        elif name == "ours":
            install_activation_offload(model, FORCED)
        with SavedActivationTracker(observe_autograd=True, ignore=model.parameters()) as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            peaks[name] = tracker.peak["device"]
            loss.backward()
        assert tracker.bytes["device"] == 0
    assert peaks["torch"] - peaks["ours"] == (L - 1) * LAYER_BYTES
    assert peaks["none"] > peaks["torch"] + 4 * L * LAYER_BYTES  # without checkpointing: all internals


def test_hidden_state_offload_grads_identical_and_params_stay():
    torch.manual_seed(0)
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(H)
    head = torch.nn.Linear(H, V, bias=False)
    targets = torch.randint(0, V, (B, T))

    def head_loss(h):
        logp = head(norm(h)).float().log_softmax(-1)
        return -logp.gather(-1, targets[..., None]).mean()

    h0 = torch.randn(B, T, H)
    results = {}
    for min_bytes in (None, 0, 1 << 30):
        h = h0.clone().requires_grad_()
        norm.zero_grad(), head.zero_grad()
        with SavedActivationTracker() as tracker:
            ctx = offload_saved_tensors(min_bytes, FORCED, keep=head.parameters()) if min_bytes is not None else None
            with ctx or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = head_loss(h)
            host_peak = tracker.peak["host"]
            loss.backward()
        assert tracker.bytes == {"device": 0, "host": 0}
        results[min_bytes] = (host_peak, h.grad, head.weight.grad.clone(), norm.weight.grad.clone())
    assert results[None][0] == 0 and results[1 << 30][0] == 0
    assert results[0][0] >= 2 * B * T * H * 4 + B * T * V * 4  # hidden states and logits went to host
    for min_bytes in (0, 1 << 30):
        for a, b in zip(results[None][1:], results[min_bytes][1:]):
            assert torch.equal(a, b)

    w = torch.nn.Parameter(torch.randn(64, H))  # a weight saved by a matmul is not copied
    x = torch.randn(3, H, requires_grad=True)
    with SavedActivationTracker() as tracker, offload_saved_tensors(0, FORCED):
        torch.nn.functional.linear(x, w).sum().backward()
        assert tracker.peak["host"] == x.numel() * 4


GROUPED = OffloadConfig(device_copies=True, use_streams=False, pin_memory=False, min_bytes=0, recompute_tokens=T)


def spy_grouped(monkeypatch):
    from grpo_accel.offload import rerun

    calls, real = [], rerun._grouped_rerun
    monkeypatch.setattr(rerun, "_grouped_rerun", lambda *a: calls.append(1) or real(*a))
    return calls


def backward_peak(model, ids, cfg=None, padded=False):
    """Grads and the peak of autograd's saved bytes during backward (the layer re-runs). cfg None: no checkpointing.
    padded: row r left-padded by r tokens, with [B, T] position ids, as TRL feeds prompts + completions: the
    layers then get a [B, 1, T, T] mask and [B, T, D] RoPE tables, which a grouped re-run must slice too."""
    kw = dict(input_ids=ids, labels=ids)
    if padded:
        mask = torch.ones_like(ids)
        for r in range(ids.shape[0]):
            mask[r, :r] = 0
        kw.update(attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                  labels=ids.masked_fill(mask == 0, -100))
    if cfg is not None:
        install_activation_offload(model, cfg)
    torch.manual_seed(1234)  # run_step's dropout masks
    with SavedActivationTracker(observe_autograd=True, ignore=model.parameters()) as tracker:
        loss = model(**kw).loss
        tracker.reset_peak()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, tracker.peak["device"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("peft,padded", [(False, False), (True, False), (True, True)],
                         ids=["full", "lora", "lora-padded"])
def test_grouped_recompute_same_grads_fewer_saved_bytes(peft, padded, monkeypatch):
    """recompute_tokens=T: 4 rows re-run one at a time. Grads equal plain training's (to fp32 rounding: the sums
    run in another order); the backward's peak of saved bytes, mostly the re-run's, shrinks."""
    rows = 4
    calls = spy_grouped(monkeypatch)
    ids = torch.randint(0, V, (rows, T), generator=torch.Generator().manual_seed(5))
    wrap = lora if peft else (lambda m: m)
    ref, _ = backward_peak(wrap(tiny_llama()), ids, None, padded)
    whole, whole_peak = backward_peak(wrap(tiny_llama()), ids, FORCED, padded)
    grouped, grouped_peak = backward_peak(wrap(tiny_llama()), ids, GROUPED, padded)
    assert ref.keys() == whole.keys() == grouped.keys() and ref
    assert len(calls) == 4  # once per layer, only in the grouped run
    for name in ref:
        torch.testing.assert_close(grouped[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # whole: 4 rows' re-run + the stash's double buffer + the head's; grouped: 1 row's re-run + the same (2.4x)
    assert grouped_peak * 2 < whole_peak, (grouped_peak, whole_peak)


def test_grouped_recompute_stays_whole_where_it_would_be_wrong(monkeypatch):
    """Live dropout (other masks than the forward's) and fitting rows keep the whole-batch re-run: bit-identical."""
    calls = spy_grouped(monkeypatch)
    ids = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(6))
    ref, _ = backward_peak(tiny_llama(dropout=0.2), ids)
    grads, _ = backward_peak(tiny_llama(dropout=0.2), ids, GROUPED)
    assert_equal(ref, grads)
    big = OffloadConfig(device_copies=True, use_streams=False, pin_memory=False, min_bytes=0, recompute_tokens=4 * T)
    ref, _ = backward_peak(tiny_llama(), ids)
    assert_equal(ref, backward_peak(tiny_llama(), ids, big)[0])
    assert not calls


def test_kwargs_nested_tensors_and_tuple_outputs():
    def fn(x, scale, *, pair, mode, bias=None):
        y = torch.tanh(x * scale) @ pair[0] + pair[1].sin()
        if mode == "with_bias":
            y = y + bias
        return y, None, {"idx": y.argmax(-1), "sq": (x**2).sum()}, mode

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g),
            torch.randn(8, generator=g)]

    def run(checkpoint):
        x, w, c, bias = (t.clone().requires_grad_() for t in base)
        args, kwargs = (x, 2.0), dict(pair=(w, c), mode="with_bias", bias=bias)
        y, none, extra, mode = checkpoint(fn, *args, **kwargs) if checkpoint else fn(*args, **kwargs)
        assert none is None and mode == "with_bias" and extra["idx"].dtype == torch.int64
        assert not extra["idx"].requires_grad
        (y.square().sum() + extra["sq"]).backward()
        return [t.grad for t in (x, w, c, bias)], y.detach()

    ref, y_ref = run(None)
    for checkpoint in (OffloadedCheckpoint(FORCED), OffloadedCheckpoint(), offloaded_checkpoint):
        grads, y = run(checkpoint)
        assert torch.equal(y, y_ref)
        for a, b in zip(ref, grads):
            assert torch.equal(a, b)


def test_frozen_params_without_input_grad_still_train_lora_style():
    """No input requires grad (frozen embedding) but the layer has trainable params: grads must flow
    without enable_input_require_grads (torch's reentrant checkpoint would silently drop them)."""
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    OffloadedCheckpoint(FORCED)(layer, x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0

    frozen = torch.nn.Linear(8, 8).requires_grad_(False)  # nothing to train: runs plainly, no graph
    assert not OffloadedCheckpoint(FORCED)(frozen, x).requires_grad
    with torch.no_grad():
        assert not OffloadedCheckpoint(FORCED)(layer, x).requires_grad


def test_misuse_raises_with_the_fix():
    layer = torch.nn.Linear(8, 8)
    ckpt = OffloadedCheckpoint(FORCED)
    x = torch.randn(4, 8, requires_grad=True)
    out = ckpt(layer, x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()
    with pytest.raises(RuntimeError, match="loss.backward"):
        torch.autograd.grad(ckpt(layer, x).sum(), x)

    # an input modified in place after the forward: caught when it is copied off (next layer's save) ...
    ckpt, y = OffloadedCheckpoint(FORCED), torch.randn(4, 8, requires_grad=True)
    h = y * 1.0
    keep = ckpt(layer, h)  # noqa: F841  (the graph, and with it the stash entry, must stay alive)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        ckpt(layer, torch.randn(4, 8))
    # ... or when the backward reads it (the newest input is kept on device, never copied)
    ckpt, h = OffloadedCheckpoint(FORCED), y * 1.0
    out = ckpt(layer, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_install_rejects_non_hf_module():
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        install_activation_offload(torch.nn.Linear(2, 2))


@pytest.mark.gpu
def test_cuda_stash_lives_in_pinned_host_memory_and_grads_match():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0)).cuda()
    ref_model = tiny_llama(layers=4, attn="eager").cuda()
    ref_model._set_gradient_checkpointing(True, functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=True))
    ref_model(input_ids=ids, labels=ids).loss.backward()

    model = tiny_llama(layers=4, attn="eager").cuda()
    ckpt = install_activation_offload(model, OffloadConfig(min_bytes=0))  # defaults: pinned, side stream
    with SavedActivationTracker() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        entries = [r() for r in ckpt.stash._entries]
        assert len(entries) == 4 and tracker.peak["device"] == LAYER_BYTES
        for e in entries[:-1]:  # offloaded: host copy pinned, device copy dropped
            assert e.dev == [None] and e.host[0].is_pinned() and e.host[0].device.type == "cpu"
        assert entries[-1].host == [None] and entries[-1].dev[0].is_cuda  # last layer's input stays
        loss.backward()
    torch.cuda.synchronize()
    assert tracker.bytes == {"device": 0, "host": 0}
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)

    h = torch.randn(B, T, H, device="cuda", requires_grad=True)
    with SavedActivationTracker() as tracker, offload_saved_tensors(min_bytes=0):
        y = (h.exp() * 2).sum()
        assert tracker.bytes["host"] >= h.numel() * 4
    y.backward()
    torch.testing.assert_close(h.grad, 2 * h.detach().exp())


ZERO3_SCRIPT = r"""
import os, torch, transformers, deepspeed
from deepspeed.utils import safe_get_full_grad
from peft import LoraConfig, get_peft_model
from grpo_accel._compat.cpu_distributed import prepare_cpu_processes
from grpo_accel.offload import OffloadConfig, install_activation_offload
prepare_cpu_processes()  # as launch/train.py does on CPU: gloo on loopback, no shm op (no JIT build, no lock)
torch.distributed.init_process_group("gloo")
FORCED = OffloadConfig(device_copies=True, use_streams=False, pin_memory=False, min_bytes=0)
DS = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # every param partitioned
      "zero_allow_untested_optimizer": True}
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

def make(peft):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).train()
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])) if peft else model

for peft in (False, True):
    model = make(peft)
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model = make(peft)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=DS, model_parameters=trainable)
    ckpt = install_activation_offload(engine, FORCED)  # unwraps DeepSpeedEngine (and PeftModel)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    assert grads.keys() == ref.keys() and len(ref) > 0
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
    assert not [r for r in ckpt.stash._entries if r() is not None]
print("ZERO3_OK")
"""


def test_zero3_param_hooks_fire_in_the_recompute(tmp_path):
    """ZeRO-3 gathers each parameter in a forward pre-hook and frees it after: the recompute in our
    backward must re-gather (it calls the submodules again), or shapes break. One process over gloo,
    in a subprocess so the process group stays out of this one."""
    import os
    import sys

    from support.launch import free_port, run_process_group

    pytest.importorskip("deepspeed")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = run_process_group([sys.executable, "-c", ZERO3_SCRIPT], 600, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "ZERO3_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "shared-memory all-reduce op skipped" in proc.stdout


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_forward_without_backward_and_deepcopy():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    model = tiny_llama()
    ckpt = install_activation_offload(model, FORCED)
    with SavedActivationTracker() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        assert tracker.bytes["host"] == 3 * LAYER_BYTES
        del loss  # graph dropped without backward: copies freed, accounts settled
        assert tracker.bytes == {"device": 0, "host": 0}
    assert not [r for r in ckpt.stash._entries if r() is not None]

    import copy

    clone = copy.deepcopy(model)  # e.g. a reference model: its own stash, enabling it leaves ours alone
    clone.gradient_checkpointing_enable()
    func = clone.model.layers[0]._gradient_checkpointing_func
    assert isinstance(func, OffloadedCheckpoint) and func is not ckpt and func.stash is not ckpt.stash
    assert model.model.layers[0]._gradient_checkpointing_func is ckpt
    remove_activation_offload(clone)
    assert model.model.layers[0]._gradient_checkpointing_func is ckpt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["torch", "offload"])
def test_autocast_state_replayed_in_recompute(mode, dtype):
    """Forward under bf16 / fp16 autocast, backward outside it: the recompute must run in that dtype again (the
    grads are then bit-identical to no checkpointing; a recompute in fp32 or the other half dtype is not)."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))

    def step(model):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref = step(tiny_llama())
    model = tiny_llama()
    if mode == "torch":
        model._set_gradient_checkpointing(True, functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=True))
    else:
        install_activation_offload(model, FORCED)
    assert_equal(ref, step(model))
