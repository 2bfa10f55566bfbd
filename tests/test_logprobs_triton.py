"""Triton folds vs the fp64 reference. On CPU they run under TRITON_INTERPRET=1 (slow: small shapes only).

OMP_NUM_THREADS=1 pytest tests/test_logprobs_triton.py -q
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
# Under the interpreter, Triton must be imported with TRITON_INTERPRET=1 (its own tl.* helpers are decorated
# then) and the flag must be set again whenever a kernel runs. torch does not import triton; if something else
# in this pytest process already did without the flag, these tests re-run in a subprocess instead.
PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
IN_PROCESS = not (INTERPRET and PREIMPORTED)


def _set_interpret(value):
    prev = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return prev


_prev = _set_interpret("1") if INTERPRET and IN_PROCESS else os.environ.get("TRITON_INTERPRET")
try:
    pytest.importorskip("triton")
    import grpo_accel.ops.logprobs_triton as lt

    if INTERPRET and IN_PROCESS and type(lt._grad_kernel).__name__ != "InterpretedFunction":
        sys.modules.pop(lt.__name__)  # imported earlier without the flag: a fresh module object
        lt = importlib.import_module(lt.__name__)
finally:
    _set_interpret(_prev)  # the flag must not leak into other tests or the subprocesses they start

from support.compare import rel_max  # noqa: E402
from support.logprob_inputs import H, grads_out, make_inputs, reference64, run  # noqa: E402

from grpo_accel.ops.logprobs import chunked_logprobs  # noqa: E402
from grpo_accel.ops.select import token_logprobs  # noqa: E402

in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton imported without TRITON_INTERPRET: see "
                                "test_rerun_in_subprocess")


@pytest.fixture(autouse=True, scope="module")
def _interpreter_for_this_module():
    prev = _set_interpret("1") if INTERPRET else None
    yield
    if INTERPRET:
        _set_interpret(prev)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@in_process
@pytest.mark.parametrize("temperature,softcap,chunk_size,vocab_tile", [
    (1.0, None, None, None),  # one block: the whole problem
    (0.7, 5.0, 16, 48),  # 3 chunks x 3 tiles, last tile 5 wide (masked lanes in every kernel)
])
def test_triton_fp32_matches_fp64_reference(temperature, softcap, chunk_size, vocab_tile):
    hidden, weight, targets = on_device(*make_inputs())
    g_lp, g_ent = on_device(*grads_out())
    logp, ent, dh, dw = run(lt.triton_logprobs, hidden, weight, targets, g_lp, g_ent, temperature=temperature,
                            softcap=softcap, compute_entropy=True, chunk_size=chunk_size, vocab_tile=vocab_tile)
    ref = reference64(hidden.cpu(), weight.cpu(), targets.cpu(), g_lp.cpu(), g_ent.cpu(), temperature, softcap)
    assert logp.dtype == torch.float32 and dh.dtype == torch.float32
    for ours, r in zip((logp, ent, dh, dw), ref):
        assert rel_max(ours.cpu(), r) < 1e-5
    assert (logp[targets == -100] == 0).all() and (dh[targets == -100] == 0).all()


@in_process
def test_triton_logp_grad_only_and_bf16():
    """Entropy computed but unused (its grad is None), bf16 inputs: same tolerance rule as the torch path."""
    hidden, weight, targets = on_device(*make_inputs(dtype=torch.bfloat16))
    g_lp, _ = on_device(*grads_out())
    kw = dict(temperature=0.7, softcap=5.0)
    ours = run(lambda *a, **k: lt.triton_logprobs(*a, compute_entropy=True, **k), hidden, weight, targets, g_lp,
               None, **kw)
    chunked = run(lambda *a, **k: chunked_logprobs(*a, compute_entropy=True, **k), hidden, weight, targets, g_lp,
                  None, **kw)
    ref = reference64(hidden.cpu(), weight.cpu(), targets.cpu(), g_lp.cpu(), None, **kw)
    assert ours[2].dtype == ours[3].dtype == torch.bfloat16
    for o, c, r in zip(ours, chunked, ref):
        # the chunked path is within 2x plain torch bf16 (test_logprobs); Triton must match its error
        assert rel_max(o.cpu(), r) <= 2 * rel_max(c.cpu(), r) + 1e-6


@in_process
def test_triton_fp64_and_dispatcher():
    hidden, weight, targets = on_device(*make_inputs(n=12, dtype=torch.float64))
    h3, t3 = hidden.view(3, 4, H), targets.view(3, 4)
    logp, ent = token_logprobs(h3, weight, t3, impl="triton", softcap=5.0, compute_entropy=True)
    rl, re = token_logprobs(h3, weight, t3, impl="reference", softcap=5.0, compute_entropy=True)
    assert logp.shape == (3, 4) and logp.dtype == torch.float64
    assert rel_max(logp, rl) < 1e-12 and rel_max(ent, re) < 1e-12


@in_process
@pytest.mark.gpu
def test_triton_bf16_gpu_larger():
    """On a GPU: the real (compiled) kernels at a shape with many blocks, vs the chunked path."""
    hidden, weight, targets = on_device(*make_inputs(n=2048, h=256, v=32003, dtype=torch.bfloat16, scale=0.3))
    g_lp, g_ent = on_device(*grads_out(2048))
    kw = dict(temperature=0.7, compute_entropy=True, chunk_size=512, vocab_tile=4096)
    ours = run(lt.triton_logprobs, hidden, weight, targets, g_lp, g_ent, **kw)
    chunked = run(chunked_logprobs, hidden, weight, targets, g_lp, g_ent, **kw)
    for o, c in zip(ours, chunked):
        assert rel_max(o, c) < 1e-2


@pytest.mark.skipif(IN_PROCESS, reason="ran in process")
def test_rerun_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"], env=env,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stdout[-3000:]
