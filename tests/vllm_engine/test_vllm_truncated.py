"""This wave's sampling features on colocated vLLM (the shared-weight engine): truncated sampling (issue 65 item 3,
trainer/truncated_sampling.py, ops/truncation.py) and dynamic sampling (issue 66, trainer/dynamic_sampling.py).
`make test-vllm`.

Truncated sampling: vLLM reports `processed_logprobs`, the truncated renormalised distribution's; the trainer adds
log Z (its old policy's mass on the support vLLM's rule keeps) so TRL's importance ratio is 1 on-policy. The
references: vLLM's own sampler functions for the support (no engine), and TRL's logged ratio through whole runs with
the correction in and taken out. Every step is on-policy (one generation per step, the engine synced before it), so
the ratio must be 1 up to the engine's fp32 gap.

Dynamic sampling: half_flat_reward makes the groups of prompts with an even answer flat, so batches need refill
rounds through the engine; the adapter is pushed once per step, not once per round (TRL's `_last_loaded_step`).
"""

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import grpo_run, report, trainer_check  # noqa: E402

from grpo_accel.ops.truncation import Truncation, kept_mask  # noqa: E402

WHY = ("vLLM's support rule is checked against its own sampler functions on both lines (test_our_support_is_vllms), "
       "its log-probs after temperature by test_vllm_rollout_budget.py's float64 forward")

# vLLM's order (min_p, then top_k, then top_p over the survivors); the last two are where min_p first or last differ
CASES = [Truncation(top_k=20), Truncation(top_p=0.9), Truncation(min_p=0.05), Truncation(top_k=1),
         Truncation(top_k=60, top_p=0.9), Truncation(top_k=60, top_p=0.9, min_p=0.1), Truncation(top_p=0.5, min_p=0.2)]


def vllm_kept(z: torch.Tensor, t: Truncation) -> torch.Tensor:
    """The support as vLLM's own sampler functions leave it (v1/sample: MinPLogitsProcessor.apply, then
    apply_top_k_top_p, the CPU route of TopKTopPSampler.forward_cpu): the finite logits."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    z = z.clone()
    rows = z.shape[0]
    if t.min_p > 0:
        processor = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # its state as update_state leaves it
        processor.min_p_count, processor.min_p = rows, torch.full((rows, 1), t.min_p)
        z = processor.apply(z)
    k = torch.full((rows,), t.top_k, dtype=torch.long) if t.top_k else None
    p = torch.full((rows,), t.top_p) if t.top_p < 1 else None
    return apply_top_k_top_p(z, k, p).isfinite()


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"k{t.top_k}-p{t.top_p}-m{t.min_p}")
def test_our_support_is_vllms(t):
    """Random fp32 logits (a few hundred tokens matter, as a trained model's; four equal ones near the top in 8 rows):
    ops/truncation.kept_mask in vLLM's order must keep exactly the tokens vLLM's sampler keeps (top_k one off, or
    min_p after top_p as transformers applies it, fail here)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 2048, generator=g) * 3
    z[:8, :4] = z[:8].amax(-1, keepdim=True) - 1.0
    ours, theirs = kept_mask(z, t), vllm_kept(z, t)
    assert torch.equal(ours, theirs), (t, (ours != theirs).sum().item())
    assert theirs.sum(-1).min() >= 1 and not theirs.all(), "nothing cut: the case tells nothing"


def test_top_p_ratio_is_one_with_the_correction_and_the_kept_mass_without(tmp_path_factory):
    """top_p 0.9, two steps (the second under the adapter its first step trained), TRL's per-token ratio
    (token_truncate, so the logged mean is over tokens): within 1% of 1 with the correction; without it, the kept
    mass, which top_p 0.9 puts in [0.9, 1) and the tiny model's nearly flat distributions put at ~0.9."""
    trainer_check(WHY)
    flags = ("--top-p", "0.9", "--is-mode", "token_truncate")
    ours = grpo_run("shared", tmp_path_factory, *flags, tiny=True)
    trl = grpo_run("shared", tmp_path_factory, *flags, "--uncorrected", tiny=True)
    report(f"top_p 0.9 on colocated vLLM: ratio means {ours['is_ratio_mean']} corrected, {trl['is_ratio_mean']} "
           f"without ({ours['train_s']:.1f} + {trl['train_s']:.1f} s training)")
    assert ours["kept_mass_correction"] and not trl["kept_mass_correction"]
    assert ours["moved"] > 0, "the adapter did not train: the second step is the first's policy"
    assert len(ours["is_ratio_mean"]) == 2
    for mean in ours["is_ratio_mean"]:
        assert abs(mean - 1) < 0.01, ours["is_ratio_mean"]
    for mean in trl["is_ratio_mean"]:
        assert 0.895 < mean < 0.95, trl["is_ratio_mean"]


def test_top_k_with_dynamic_sampling_refills_syncs_once_a_step_and_keeps_the_ratio_at_one(tmp_path_factory):
    """top_k 20 (TRL's default sequence-level ratio: a product over ~24 tokens, each ~20/vocab uncorrected) and
    --dynamic_sampling with half_flat_reward, three steps: some batch needs refill rounds through the engine; the
    adapter goes to the engine once per step whatever the rounds; every round's ratio is 1 within 1%."""
    trainer_check(WHY)
    r = grpo_run("shared", tmp_path_factory, "--top-k", "20", "--dynamic-sampling", "--steps", "3", tiny=True)
    report(f"top_k 20 + dynamic sampling on colocated vLLM: rounds {r['sampling_rounds']}, groups kept "
           f"{r['groups_kept']}, engine calls {r['engine_generate_calls']}, syncs at steps {r['synced_at']}, "
           f"ratio means {r['is_ratio_mean']} ({r['train_s']:.1f} s training)")
    assert r["kept_mass_correction"] and len(r["losses"]) == 3
    assert max(r["sampling_rounds"]) > 1, r["sampling_rounds"]
    assert len(r["engine_generate_calls"]) == sum(r["sampling_rounds"]), "a round did not go through the engine"
    assert r["synced_at"] == sorted(set(r["synced_at"])) and len(r["synced_at"]) == 3, r["synced_at"]
    assert r["moved"] > 0
    for mean in r["is_ratio_mean"]:
        assert abs(mean - 1) < 0.01, r["is_ratio_mean"]
