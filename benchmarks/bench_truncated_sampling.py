"""The importance ratio TRL computes on-policy under truncated sampling, before and after putting the behaviour
log-prob on the trainer's distribution (issue 65 item 3; grpo_accel/ops/truncation.py, docs/off-policy-rollouts.md
"Truncated sampling"). Goal: the ratio's mean within 1% of 1, where TRL 1.16's sits at the kept mass.

    python benchmarks/bench_truncated_sampling.py    # ~3 min on 2 shared cores (the embedded SmolLM2-135M, fp32)

What runs: 8 arithmetic prompts x 4 completions of <= 48 tokens sampled by transformers' continuous batching (the
sampler of route continuous_batching under --rollout_budget, `return_logprobs`: the truncated, renormalised
log-prob) from the embedded SmolLM2-135M-Instruct in fp32 at temperature 0.7; then the trainer's side on the same
weights: our fused head's full tempered log-prob of each token (the old pass) and log Z (the mass that distribution
puts on the sampler's support, transformers' rule). Per token, TRL's ratio exp(old - behaviour) ("before") and
exp(old - (behaviour + log Z)) ("after"); rows: mean, min, max over completion tokens, and the mean kept mass.
Writes benchmarks/results/truncated_sampling.csv and .png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from harness import ROOT, run_meta, write_results

RESULTS = ROOT / "benchmarks" / "results" / "truncated_sampling.csv"
SETTINGS = {"top_p 0.9": dict(top_p=0.9), "top_k 50": dict(top_k=50), "min_p 0.1": dict(min_p=0.1)}
PROMPTS, G, C, TEMPERATURE = 8, 4, 48, 0.7


def sample(model, tokenizer, prompts: list[list[int]], truncation: dict) -> list[tuple[list[int], list[float]]]:
    """Each prompt's G completions and their recorded behaviour log-probs (transformers' continuous batching)."""
    from transformers import GenerationConfig

    from grpo_accel.generation.continuous_batching import paged_decode

    gen = GenerationConfig(do_sample=True, temperature=TEMPERATURE, max_new_tokens=C, **{"top_k": 0, **truncation},
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    with paged_decode(model, gen) as decode:
        out = decode([p for p in prompts for _ in range(G)], [C] * (len(prompts) * G))
    return [(ids, logps) for ids, logps, _ in out]


@torch.no_grad()
def trainer_side(model, prompt: list[int], ids: list[int], truncation):
    """(full tempered log-probs, log Z) of completion `ids` after `prompt`, through our head's ops."""
    from grpo_accel.ops.select import token_logprobs
    from grpo_accel.ops.truncation import log_kept_mass

    seq = torch.tensor([prompt + ids])
    hidden = model.model(input_ids=seq).last_hidden_state[0, len(prompt) - 1:-1]
    weight = model.get_output_embeddings().weight
    logp, _ = token_logprobs(hidden, weight, torch.tensor(ids), temperature=TEMPERATURE)
    return logp, log_kept_mass(hidden, weight, truncation, temperature=TEMPERATURE)


def measure(model, tokenizer, prompts, name: str, truncation: dict) -> list[dict]:
    from grpo_accel.ops.truncation import Truncation

    rule = Truncation(min_p_first=False, **truncation)  # transformers' order: the sampler here
    before, after, kept = [], [], []
    for k, (ids, behaviour) in enumerate(sample(model, tokenizer, prompts, truncation)):
        if not ids:
            continue
        old, log_z = trainer_side(model, prompts[k // G], ids, rule)
        b = torch.tensor(behaviour)
        before.append(torch.exp(old - b))
        after.append(torch.exp(old - (b + log_z)))
        kept.append(log_z.exp())
    shape = f"smollm2-135m,fp32,T{TEMPERATURE},{name},{PROMPTS}x{G}x{C}"
    rows = []
    for impl, ratio in (("trl_1.16", torch.cat(before)), ("behaviour_plus_log_z", torch.cat(after))):
        for metric, value in (("ratio_mean", ratio.mean()), ("ratio_min", ratio.min()), ("ratio_max", ratio.max())):
            rows.append(dict(op="importance_ratio_on_policy", impl=impl, shape=shape, metric=metric,
                             value=f"{value.item():.6g}", unit="ratio"))
    rows.append(dict(op="importance_ratio_on_policy", impl="trl_1.16", shape=shape, metric="kept_mass_mean",
                     value=f"{torch.cat(kept).mean().item():.6g}", unit="probability"))
    print(f"{name:10s} tokens {torch.cat(before).numel():5d}  kept mass {torch.cat(kept).mean():.4f}  ratio mean "
          f"before {torch.cat(before).mean():.4f}  after {torch.cat(after).mean():.4f}", flush=True)
    return rows


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = [r for r in rows if r["metric"] == "ratio_mean"]
    shapes = list(dict.fromkeys(r["shape"] for r in means))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (impl, label) in enumerate((("trl_1.16", "before: TRL 1.16 (behaviour truncated)"),
                                       ("behaviour_plus_log_z", "after: behaviour + log Z"))):
        vals = [next(float(r["value"]) for r in means if r["shape"] == s and r["impl"] == impl) for s in shapes]
        ax.bar([x + i * 0.4 for x in range(len(shapes))], vals, 0.4, label=label)
    ax.axhspan(0.99, 1.01, color="green", alpha=0.15, label="goal: within 1% of 1")
    ax.set_xticks([x + 0.2 for x in range(len(shapes))], [s.split(",")[3] for s in shapes])
    ax.set_ylim(0.5, 1.1)
    ax.set_ylabel("mean importance ratio, on-policy")
    ax.set_title(f"SmolLM2-135M fp32, T={TEMPERATURE}, transformers' continuous batching as the sampler")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from grpo_accel.data.datasets import arithmetic_rows
    from grpo_accel.data.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m-instruct")
    model.eval()
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
               for r in arithmetic_rows("train", PROMPTS)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    rows = [row for name in args.settings for row in measure(model, tokenizer, prompts, name, SETTINGS[name])]
    write_results(rows, args.out, run_meta("cpu", packages=("torch", "transformers")), plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
