"""Routing replay's effect and cost (issue 65): the two MoE twins in bf16 on route continuous_batching, on-policy and
with --rollout_budget, with --routing_replay false (the sampler's routing recorded and compared, not replayed), true
(replayed), and `none` (the recording switched off in-process: what the run costs without any routing work).

    .venv/bin/python benchmarks/bench_routing_replay.py --steps 8          # nothing else running

Per run (GRPOAccelTrainer in this process, full fine-tuning of a random tiny twin in bf16 weights, lr 1e-3 so the
router moves between steps, 2 prompts x 4 completions, completions up to 32 tokens, budget rounds of 8): the mean over
steps of routing/flip_frac (trainer top-k != sampler's), routing/applied_flip_frac (ran on other experts than
sampled), TRL's sampling/sampling_logp_difference/mean (|old - behaviour| log-prob; only where behaviour log-probs
exist: the budgeted route's carried tokens) and the median step seconds. Writes benchmarks/results/routing_replay.csv
(long format), its PNG and card.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, run_meta, write_results

RESULTS = ROOT / "benchmarks" / "results" / "routing_replay.csv"
TWINS = ("tiny-gpt-oss", "tiny-qwen3-moe")
IMPLS = ("none", "false", "true")
FIGURES = {"routing/flip_frac": "flip_frac", "routing/applied_flip_frac": "applied_flip_frac",
           "sampling/sampling_logp_difference/mean": "sampling_logp_difference_mean",
           "sampling/k3_kl": "k3_kl"}


def run(name: str, impl: str, budget: int, args, out: Path) -> list[dict]:
    """One training run; its logged steps, each with `step_s` (wall seconds of the step, generation included)."""
    import torch
    from transformers import TrainerCallback

    from grpo_accel.data.datasets import arithmetic_dataset
    from grpo_accel.data.models import build_tiny_model, load_tokenizer
    from grpo_accel.trainer import carried_rollouts, paged_generation
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.t0)

    torch.manual_seed(args.seed)
    tok = load_tokenizer(name)
    model = build_tiny_model(name, tok).to(torch.bfloat16)
    config = GRPOAccelConfig(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
        report_to="none", seed=args.seed, beta=0.0, logging_steps=1, save_steps=1000, max_steps=args.steps,
        bf16=False, learning_rate=1e-3, use_transformers_continuous_batching=True, rollout_budget=budget,
        transformers_continuous_batching_config=dict(num_blocks=64, page_size=16, max_batch_tokens=512),
        offload_activations="false", routing_replay="false" if impl == "none" else impl)
    capture = paged_generation.routing_capture
    if impl == "none":  # no recording: no records, nothing measured or replayed (both routes' reads)
        paged_generation.routing_capture = carried_rollouts.routing_capture = lambda trainer: None
    try:
        trainer = GRPOAccelTrainer(model=model, reward_funcs=[length_reward], args=config, processing_class=tok,
                                   train_dataset=arithmetic_dataset("train", 64))
        trainer.generation_config.eos_token_id = [tok.eos_token_id, *range(1000, 4000)]  # lengths vary
        clock = Clock()
        trainer.add_callback(clock)
        trainer.train()
    finally:
        paged_generation.routing_capture = carried_rollouts.routing_capture = capture
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [dict(h, step_s=s) for h, s in zip(logs, clock.seconds)]


def length_reward(completions, **kwargs):
    return [min(len(c if isinstance(c, str) else c[0]["content"]), 64) / 64 for c in completions]


def summarize(name: str, impl: str, budget: int, steps: list[dict], args) -> list[dict]:
    shape = f"{name},bf16,G=4,prompts=2,C=32,route=continuous_batching,rollout_budget={budget},steps={args.steps}"
    metrics = [("step_s_median", statistics.median(h["step_s"] for h in steps[1:]), "s")]  # the first: warm-up
    for key, metric in FIGURES.items():
        seen = [float(h[key]) for h in steps if h.get(key) is not None]
        if seen:
            metrics.append((metric + "_mean", statistics.mean(seen), "fraction" if "frac" in key else "nats"))
    return [dict(op="routing_replay", impl=f"replay_{impl}", shape=shape, metric=m, value=f"{v:.4g}", unit=u)
            for m, v, u in metrics]


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("flip_frac_mean", "applied_flip_frac_mean")):
        want = [r for r in rows if r["metric"] == metric]
        labels = [f"{r['shape'].split(',')[0]}\n{r['shape'].split(',')[5]}\n{r['impl']}" for r in want]
        ax.bar(range(len(want)), [float(r["value"]) for r in want])
        ax.set_xticks(range(len(want)), labels, fontsize=6)
        ax.set_title(metric.replace("_mean", " (mean over steps)"))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--twins", nargs="+", default=list(TWINS), choices=TWINS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    tmp, rows = Path(tempfile.mkdtemp(prefix="bench_routing_replay_")), []
    for name in args.twins:
        for budget in (0, 8):
            for impl in IMPLS:
                steps = run(name, impl, budget, args, tmp / f"{name}-{budget}-{impl}")
                got = summarize(name, impl, budget, steps, args)
                rows += got
                print(f"{name} budget {budget} replay {impl}: " + ", ".join(f"{r['metric']} {r['value']}"
                                                                          for r in got), flush=True)
    write_results(rows, args.out, run_meta("cpu", packages=("torch", "transformers", "trl")), plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
