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
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

from campaign.results_io import (  # benchmarks/ is on sys.path when run as a script
    already_measured,
    killed_result,
    killed_rows,
    run_meta,
    run_worker_process,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20
VARIANTS = ("shared", "packed", "trl_padded")
RESULT_TAG = "RESULT "
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
    if a.impl == "trl_padded":
        return GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    args = GRPOAccelConfig(**common, padding_free=True, share_prompt="true" if a.impl == "shared" else "false",
                           offload_activations=a.offload)
    return GRPOAccelTrainer(args=args, **kwargs)


def worker(a):
    import torch

    sys.path.insert(0, str(ROOT))
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
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    V = model.config.get_text_config().vocab_size
    inputs, unshared, shared = make_inputs(a.generations, a.prompt_length, a.completion_length, V, a.device)
    measured = measured_steps(trainer, inputs, mem, base, a.reps, cuda)
    if measured is None:
        return
    layer_tokens = {"shared": shared, "packed": unshared,
                    "trl_padded": GROUPS * a.generations * (a.prompt_length + a.completion_length)}[a.impl]
    out = dict(oom=False, checkpointing=checkpointing, time_ms=[s["ms"] for s in measured],
               cpu_ms=[s["cpu_ms"] for s in measured], peak_mib=max(s["peak"] for s in measured),
               loss=measured[0]["loss"], grad_norm=measured[0]["grad_norm"], layer_tokens=layer_tokens,
               share_prompt=getattr(trainer, "share_prompt", None), load_1min=os.getloadavg()[0])
    if cuda:
        out["peak_reserved_mib"] = max(s["reserved"] for s in measured)
    print(RESULT_TAG + json.dumps(out), flush=True)


def run_worker(args, impl, P, C, G):
    env = dict(os.environ)
    if args.device == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # peak RSS follows live tensors (bench_step_memory.py)
        if args.offload == "true":
            env["GRPO_ACCEL_OFFLOAD_FORCE_COPIES"] = "1"
    cmd = [sys.executable, __file__, "--worker", impl, "--arch", args.arch, "--device", args.device,
           "--generations", str(G), "--prompt-length", str(P), "--completion-length", str(C),
           "--reps", str(args.reps), "--offload", args.offload, "--layers", str(args.layers or 0)]
    run = run_worker_process(cmd, env, ROOT, timeout_s=args.timeout)
    if run["timed_out"]:
        return {"oom": False, "timeout": True}
    lines = [ln for ln in run["stdout"].splitlines() if ln.startswith(RESULT_TAG)]
    if not lines and run["signal"]:  # no message of its own (the OOM killer's 9): the signal and free memory say why
        return killed_result(impl, run)
    if not lines:
        print(run["stderr"][-3000:], file=sys.stderr)
        raise SystemExit(f"{impl} P={P} C={C} G={G} failed (rc {run['returncode']})")
    return json.loads(lines[-1][len(RESULT_TAG):])


def shape_of(args, P, C, G):
    dtype = "bf16" if args.device == "cuda" else "fp32"
    layers = f"-{args.layers}layers" if args.layers else ""
    return (f"{args.arch}{layers},lora-r16,{GROUPS}x{G} rows,P={P},C<={C},{dtype}"
            + (",offload" if args.offload == "true" else ""))


def rows_of(res, shape, impl):
    if res.get("timeout"):
        return [dict(op="grpo_policy_step", impl=impl, shape=shape, metric="timeout", value="1", unit="bool")]
    metrics = killed_rows(res) if "killed_by_signal" in res else [("oom", float(res["oom"]), "bool")]
    if res.get("host_refused"):
        metrics.append(("host_budget_refused", 1.0, "bool"))
    if not (res["oom"] or "killed_by_signal" in res):
        metrics += [("step_time_ms", statistics.median(res["time_ms"]), "ms"),
                    ("peak_step_mem_mib", res["peak_mib"], "MiB"), ("layer_tokens", res["layer_tokens"], "tokens"),
                    ("loss", res["loss"], "nats"), ("lora_grad_norm", res["grad_norm"], "1"),
                    ("load_1min", res["load_1min"], "procs")]
        if "peak_reserved_mib" in res:
            metrics.append(("peak_reserved_mib", res["peak_reserved_mib"], "MiB"))
        else:
            metrics.append(("step_cpu_ms", statistics.median(res["cpu_ms"]), "ms"))
    return [dict(op="grpo_policy_step", impl=impl, shape=shape, metric=m, value=f"{v:.6g}", unit=u)
            for m, v, u in metrics]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["device"], r["shape"]) for r in rows})
    panels = [("step_time_ms", "policy step time (ms)"), ("peak_step_mem_mib", "peak above the model (MiB)"),
              ("peak_reserved_mib", "peak reserved (MiB, CUDA)")]
    panels = [p for p in panels if any(r["metric"] == p[0] for r in rows)]
    if not panels:  # every variant out of memory, killed or timed out: nothing to draw (the CSV says so)
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(max(9, 1.6 * len(groups) * len(panels) + 4), 4.8),
                             squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for k, impl in enumerate(VARIANTS):
            xs, vals = [], []
            for i, g in enumerate(groups):
                v = [float(r["value"]) for r in rows if (r["device"], r["shape"]) == g and r["impl"] == impl
                     and r["metric"] == metric]
                if v:
                    xs.append(i + 0.27 * k)
                    vals.append(v[0])
            bars = ax.bar(xs, vals, 0.27, label=impl, color=f"C{k}")
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        ax.set_xticks([i + 0.27 for i in range(len(groups))])
        ax.set_xticklabels(["\n".join([*s.split(",")[2:5], d.split(" (")[0][:20]]) for d, s in groups], fontsize=6)
        ax.set_title(label, fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("GRPO policy step: prompt once per group (shared) vs each row whole (packed) vs TRL's padded rows",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", metavar="IMPL", choices=VARIANTS, help=argparse.SUPPRESS)
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
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", type=Path, default=RESULTS / "shared_prompt.csv")
    p.add_argument("--resume", action="store_true", help="skip variants --out already has from this sha and device "
                   "(campaign/run.py's retry of a failed row runs only what failed)")
    return p.parse_args()


def main():
    args = parse_args()
    if args.worker:
        args.impl = args.worker
        return worker(args)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = run_meta(args.device, ("torch", "trl", "transformers"))
    rows = []
    for P, C, G in itertools.product(args.prompt_lengths, args.completion_lengths, args.generations_grid):
        shape = shape_of(args, P, C, G)
        results = {}
        for impl in args.impls:  # each variant's rows into the CSV as soon as it ends: a later kill loses none
            if args.resume and already_measured(args.out, meta, "grpo_policy_step", impl, shape):
                print(f"{impl} {shape}: measured before at this sha and device (--resume): skipped", flush=True)
                continue
            results[impl] = run_worker(args, impl, P, C, G)
            done = rows_of(results[impl], shape, impl)
            write_results(done, args.out, meta)
            rows += done
        ok = {k: v for k, v in results.items() if not (v.get("oom") or v.get("timeout") or "killed_by_signal" in v)}
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
    write_results(rows, args.out, meta, plot)
    if any(r["metric"] == "killed_by_signal" for r in rows):
        raise SystemExit("a variant's worker was killed (killed_by_signal above): its row failed, the others are in "
                         "the CSV")


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # the stack's teardown is seconds of a core per process
