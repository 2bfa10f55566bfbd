"""One GRPO policy step (forward + backward, no generation): the prompt once per group vs G times.

    # CPU, the issue's point (SmolLM2-135M shape cut to 4 layers, fp32, LoRA r16; ~6 min on 2 cores)
    OMP_NUM_THREADS=2 python benchmarks/bench_shared_prompt.py --prompt-lengths 2048 --completion-lengths 256 \
        --generations-grid 8 --layers 4
    # GPU (issue 28's goal): Qwen3-8B-shaped LoRA, bf16, P=8K, C=1K, G=16 (and the full grid without the flags)
    python benchmarks/bench_shared_prompt.py --arch qwen3-8b --prompt-lengths 8192 --completion-lengths 1024 \
        --generations-grid 16 --offload true

Batch: 2 groups of G rows (2 prompts of P tokens, random ids), completion lengths uniform over 50-100% of C with
one at exactly C (a completion cut at the cap), TRL's layout (left-padded prompts, right-padded completions).
Variants, each in a fresh subprocess (its own allocator and peak), same seed, same LoRA init, same batch:
  shared      GRPOAccelTrainer, padding_free, share_prompt="true" (grpo_accel/parallel/shared_prompt.py)
  packed      GRPOAccelTrainer, padding_free, share_prompt="false" (today's path: each row whole, no padding)
  trl_padded  TRL's GRPOTrainer as shipped (its own head, padded [B, T] rows), gradient checkpointing on
Step: `trainer.compute_loss(model, inputs)` (TRL's loss) + `backward()`, checkpointing on as Trainer.train() does.
Metrics: step_time_ms (median of --reps after a warm-up), step_cpu_ms (CPU only), peak_step_mem_mib (peak above
the built model: CUDA max_memory_allocated, CPU VmHWM RSS), peak_reserved_mib (CUDA), tokens through the layers,
loss and lora_grad_norm (equal across variants: the same computation). Writes benchmarks/results/shared_prompt.csv
(+ .png).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import tempfile

import harness  # benchmarks/ is on sys.path when run as a script

VARIANTS = ("shared", "packed", "trl_padded")
GROUPS = 2


def make_inputs(G, P, C, V, device):
    import torch

    g = torch.Generator().manual_seed(1)
    B = GROUPS * G
    c_len = [max(1, round(C * (0.5 + 0.5 * float(u)))) for u in torch.rand(B, generator=g)]
    c_len[0] = C
    prompts = torch.randint(3, V, (GROUPS, P), generator=g).repeat_interleave(G, 0)
    cols = torch.arange(C)
    completion_mask = (cols[None] < torch.tensor(c_len)[:, None]).long()
    inputs = dict(prompt_ids=prompts, prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=torch.randint(3, V, (B, C), generator=g), completion_mask=completion_mask,
                  advantages=torch.randn(B, generator=g), old_per_token_logps=torch.full((B, C), -math.log(V)),
                  num_items_in_batch=completion_mask.sum())
    unshared = B * P + sum(c_len)
    shared = GROUPS * (P - 1) + sum(c + 1 for c in c_len)
    return {k: v.to(device) for k, v in inputs.items()}, unshared, shared


def build_trainer(a, model, tmp):
    import torch
    from bench_step_memory import synthetic_tokenizer
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    cuda = a.device == "cuda"
    G, B = a.generations, GROUPS * a.generations
    common = dict(output_dir=tmp, per_device_train_batch_size=B, num_generations=G,
                  max_completion_length=a.completion_length, report_to="none", bf16=cuda, use_cpu=not cuda, seed=0,
                  gradient_checkpointing=True)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = dict(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                  processing_class=synthetic_tokenizer(), train_dataset=Dataset.from_dict({"prompt": ["x"] * B}),
                  peft_config=lora)
    torch.manual_seed(0)  # same LoRA init in every variant
    if a.worker == "trl_padded":
        return GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    args = GRPOAccelConfig(**common, padding_free=True, share_prompt="true" if a.worker == "shared" else "false",
                           offload_activations=a.offload)
    return GRPOAccelTrainer(args=args, **kwargs)


def worker(a) -> dict:
    import torch
    from bench_packing import measured_steps
    from bench_step_memory import build_model, enable_checkpointing_like_train

    from grpo_accel.core.phase_memory import PhaseMemory

    cuda = a.device == "cuda"
    mem = PhaseMemory(a.device)
    with tempfile.TemporaryDirectory() as tmp, mem.phase("load"):
        model = build_model(a.arch, a.device, torch.bfloat16 if cuda else torch.float32, "none", None, a.layers)
        trainer = build_trainer(a, model, tmp)
        checkpointing = enable_checkpointing_like_train(trainer)
    base = mem.records[-1].end_bytes
    V = trainer.model.config.get_text_config().vocab_size
    inputs, unshared, shared = make_inputs(a.generations, a.prompt_length, a.completion_length, V, a.device)
    measured = measured_steps(trainer, inputs, mem, base, a.reps, cuda)
    if isinstance(measured, dict):  # out of memory: its result
        return measured
    layer_tokens = {"shared": shared, "packed": unshared,
                    "trl_padded": GROUPS * a.generations * (a.prompt_length + a.completion_length)}[a.worker]
    out = dict(oom=False, checkpointing=checkpointing, time_ms=[s["ms"] for s in measured],
               cpu_ms=[s["cpu_ms"] for s in measured], peak_mib=max(s["peak"] for s in measured),
               loss=measured[0]["loss"], grad_norm=measured[0]["grad_norm"], layer_tokens=layer_tokens,
               share_prompt=getattr(trainer, "share_prompt", None), load_1min=os.getloadavg()[0])
    if cuda:
        out["peak_reserved_mib"] = max(s["reserved"] for s in measured)
    return out


def run_worker(args, impl, P, C, G):
    flags = harness.cli_flags(dict(arch=args.arch, device=args.device, generations=G, prompt_length=P,
                                   completion_length=C, reps=args.reps, offload=args.offload, layers=args.layers))
    return harness.run_worker(__file__, flags, impl, env=harness.step_env(args.device, args.offload == "true"),
                              timeout_s=args.timeout, label=f"P={P} C={C} G={G}")


def shape_of(args, P, C, G):
    dtype = "bf16" if args.device == "cuda" else "fp32"
    layers = f"-{args.layers}layers" if args.layers else ""
    return (f"{args.arch}{layers},lora-r16,{GROUPS}x{G} rows,P={P},C<={C},{dtype}"
            + (",offload" if args.offload == "true" else ""))


def rows_of(res, shape, impl):
    if res.get("timed_out"):  # this CSV's name for it (campaign/summary.py reads it)
        return [dict(op="grpo_policy_step", impl=impl, shape=shape, metric="timeout", value="1", unit="bool")]
    metrics = harness.failure_metrics(res)
    if not harness.failed(res):
        metrics += [("step_time_ms", statistics.median(res["time_ms"]), "ms"),
                    ("peak_step_mem_mib", res["peak_mib"], "MiB"), ("layer_tokens", res["layer_tokens"], "tokens"),
                    ("loss", res["loss"], "nats"), ("lora_grad_norm", res["grad_norm"], "1"),
                    ("load_1min", res["load_1min"], "procs")]
        if "peak_reserved_mib" in res:
            metrics.append(("peak_reserved_mib", res["peak_reserved_mib"], "MiB"))
        else:
            metrics.append(("step_cpu_ms", statistics.median(res["cpu_ms"]), "ms"))
    return harness.long_rows("grpo_policy_step", impl, shape, metrics)


def plot(rows, path):
    harness.grouped_bars(rows, path, [("step_time_ms", "policy step time (ms)"),
                                      ("peak_step_mem_mib", "peak above the model (MiB)"),
                                      ("peak_reserved_mib", "peak reserved (MiB, CUDA)")],
                         group=lambda r: (r["device"], r["shape"]), series=lambda r: r["impl"], order=VARIANTS,
                         sort=True, fmt="%.0f",
                         tick=lambda g: "\n".join([*g[1].split(",")[2:5], g[0].split(" (")[0][:20]]),
                         title="GRPO policy step: prompt once per group (shared) vs each row whole (packed) vs TRL's "
                               "padded rows")


def parse_args(argv=None):
    p = harness.parser(__doc__, "shared_prompt.csv", worker=VARIANTS, device=True, resume=True)
    p.add_argument("--prompt-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--completion-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--generations", type=int, help=argparse.SUPPRESS)
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048, 8192], help="P grid")
    p.add_argument("--completion-lengths", type=int, nargs="+", default=[256, 1024], help="C grid")
    p.add_argument("--generations-grid", type=int, nargs="+", default=[4, 8, 16], dest="generations_grid",
                   help="G grid")
    p.add_argument("--impls", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--arch", default="smollm2-135m", help="a name from grpo_accel.planning.architectures")
    p.add_argument("--layers", type=int, default=0, help="cut the architecture to this many layers (0: all)")
    p.add_argument("--reps", type=int, default=2, help="measured steps after the warm-up; time is their median")
    p.add_argument("--offload", default="false", choices=["true", "false"], help="offload_activations (ours)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per variant and point")
    return harness.parse(p, argv, worker)


def main(argv=None):
    args = parse_args(argv)
    run = harness.Results.of(args, ("torch", "trl", "transformers"), plot)
    for P, C, G in itertools.product(args.prompt_lengths, args.completion_lengths, args.generations_grid):
        shape = shape_of(args, P, C, G)
        results = {}
        for impl in args.impls:
            if not run.skip("grpo_policy_step", impl, shape, what=shape):
                results[impl] = run_worker(args, impl, P, C, G)
                run.save(rows_of(results[impl], shape, impl))
        ok = {k: v for k, v in results.items() if not harness.failed(v)}
        if "shared" in ok and "packed" in ok:
            sh, pk = ok["shared"], ok["packed"]
            line = (f"{shape}: shared step {statistics.median(pk['time_ms']) / statistics.median(sh['time_ms']):.2f}x "
                    f"faster than packed, peak {sh['peak_mib'] / max(pk['peak_mib'], 1e-9):.2f}x; tokens "
                    f"{sh['layer_tokens']} vs {pk['layer_tokens']}; loss {sh['loss']:.6g} vs {pk['loss']:.6g}, "
                    f"grad norm {sh['grad_norm']:.6g} vs {pk['grad_norm']:.6g}")
            if "trl_padded" in ok:
                tp = ok["trl_padded"]
                line += (f"; vs TRL padded {statistics.median(tp['time_ms']) / statistics.median(sh['time_ms']):.2f}x "
                         f"faster, peak {sh['peak_mib'] / max(tp['peak_mib'], 1e-9):.2f}x")
            print(line, flush=True)
    run.finish()


if __name__ == "__main__":
    harness.run(main)
