"""One GRPO step (policy forward + backward, no generation), padded rows vs padding-free packed rows.

    # CPU (fp32, SmolLM2-135M shape, G=8, P<=64, T=256; 13 min on a busy 2-core host)
    OMP_NUM_THREADS=1 python benchmarks/bench_packing.py --arch smollm2-135m --num-generations 8 \
        --prompt-length 64 --completion-length 256 --reps 2
    # GPU (issue 16): Llama-3.1-8B-shaped LoRA bf16, G=8, T=8192, offload on (the 8B step needs it at T=8K)
    python benchmarks/bench_packing.py --arch llama-3.1-8b --num-generations 8 --prompt-length 256 \
        --completion-length 8192 --offload true --reps 2

Batch: G rows; prompt lengths uniform over 50-100% of P (left-padded), completion lengths drawn per `--mixes`:
  uniform    uniform over 5-100% of T (the issue's spread)
  long_tail  80% of rows over 5-20% of T, 20% at 60-100% (most stop early, a few run long)
and one row at exactly T (a completion cut at the limit), which sets the padded width as TRL pads a batch to
its longest completion. Token ids are random; old_per_token_logps is fixed (-log V) so the loss depends on
the log-probs.
Step: `trainer.compute_loss(model, inputs)` (TRL's `_compute_loss`) + `backward()`, gradient checkpointing on as
`Trainer.train()` switches it on; same seed, same LoRA init, same batch in both variants:
  padded   GRPOAccelTrainer, padding_free=False (TRL's [B, T] layout into our fused head)
  packed   GRPOAccelTrainer, padding_free=True (grpo_accel/parallel/packing.py; default token budget: the padded rows)
Each variant runs in a fresh subprocess (its own allocator state and peak).
Metrics: step_time_ms (median of --reps after a warm-up), tokens_per_s (real prompt + completion tokens / step
time), step_cpu_ms and tokens_per_cpu_s (CPU only: the process's CPU time, which other jobs on the host
inflate far less than wall time; with OMP_NUM_THREADS=1 it is the step's compute), peak_step_mem_mib (peak
above the built model: CUDA max_memory_allocated, CPU VmHWM RSS with a fixed glibc mmap threshold as in
bench_step_memory.py), peak_reserved_mib (CUDA), real/padded tokens, loss and lora_grad_norm (equal across
variants = same computation). Writes benchmarks/results/packing.csv (+ .png).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import harness  # benchmarks/ is on sys.path when run as a script
from harness import MIB

VARIANTS = {"padded": False, "packed": True}
MIXES = ("uniform", "long_tail")


def completion_lengths(mix: str, G: int, T: int, gen) -> list[int]:
    import torch

    u = torch.rand(G, generator=gen)
    if mix == "uniform":
        frac = 0.05 + 0.95 * u
    else:
        long_rows = torch.rand(G, generator=gen) < 0.2
        frac = torch.where(long_rows, 0.6 + 0.4 * u, 0.05 + 0.15 * u)
    lengths = [max(1, round(float(f) * T)) for f in frac]
    lengths[0] = T  # one completion runs to the limit, as in a batch where some are cut at max_completion_length
    return lengths


def make_inputs(mix, G, P, T, V, device):
    """TRL's layout: prompts left-padded to the longest prompt, completions right-padded to the longest one."""
    import torch

    g = torch.Generator().manual_seed(1)
    c_len = completion_lengths(mix, G, T, g)
    p_len = [max(1, round(P * (0.5 + 0.5 * float(x)))) for x in torch.rand(G, generator=g)]
    Pw, Tw = max(p_len), max(c_len)
    cols_p, cols_c = torch.arange(Pw), torch.arange(Tw)
    prompt_mask = (cols_p[None] >= Pw - torch.tensor(p_len)[:, None]).long()
    completion_mask = (cols_c[None] < torch.tensor(c_len)[:, None]).long()
    inputs = dict(
        prompt_ids=torch.randint(3, V, (G, Pw), generator=g), prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, V, (G, Tw), generator=g), completion_mask=completion_mask,
        advantages=torch.randn(G, generator=g), old_per_token_logps=torch.full((G, Tw), -math.log(V)),
        num_items_in_batch=completion_mask.sum(),
    )
    return {k: v.to(device) for k, v in inputs.items()}, sum(p_len) + sum(c_len), G * (Pw + Tw)


def worker(a) -> dict:
    import torch
    from bench_step_memory import build_model, enable_checkpointing_like_train, synthetic_tokenizer
    from datasets import Dataset
    from peft import LoraConfig

    from grpo_accel.core.phase_memory import PhaseMemory
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    cuda = a.device == "cuda"
    mem = PhaseMemory(a.device)
    G, T = a.num_generations, a.completion_length
    with tempfile.TemporaryDirectory() as tmp, mem.phase("load"):
        model = build_model(a.arch, a.device, torch.bfloat16 if cuda else torch.float32, "none", None)
        torch.manual_seed(0)  # same LoRA init in both variants
        args = GRPOAccelConfig(output_dir=tmp, per_device_train_batch_size=G, num_generations=G,
                               max_completion_length=T, report_to="none", bf16=cuda, use_cpu=not cuda, seed=0,
                               padding_free=VARIANTS[a.worker], offload_activations=a.offload)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = GRPOAccelTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                   args=args, processing_class=synthetic_tokenizer(),
                                   train_dataset=Dataset.from_dict({"prompt": ["x"] * G}), peft_config=lora)
        checkpointing = enable_checkpointing_like_train(trainer)
    base = mem.records[-1].end_bytes
    V = trainer.model.config.get_text_config().vocab_size
    inputs, real_tokens, padded_tokens = make_inputs(a.mix, G, a.prompt_length, T, V, a.device)
    measured = measured_steps(trainer, inputs, mem, base, a.reps, cuda)
    if isinstance(measured, dict):  # out of memory: its result
        return measured
    out = dict(oom=False, padding_free=trainer.padding_free, checkpointing=checkpointing,
               time_ms=[s["ms"] for s in measured], cpu_ms=[s["cpu_ms"] for s in measured],
               peak_mib=max(s["peak"] for s in measured),
               loss=measured[0]["loss"], grad_norm=measured[0]["grad_norm"], real_tokens=real_tokens,
               padded_tokens=padded_tokens, base_mib=base / MIB, load_1min=os.getloadavg()[0])
    if cuda:
        out["peak_reserved_mib"] = max(s["reserved"] for s in measured)
    return out


def measured_steps(trainer, inputs, mem, base: int, reps: int, cuda: bool) -> list[dict] | dict:
    """A warm-up and `reps` steps of TRL's loss + backward on `inputs`, each a PhaseMemory phase: the measured steps'
    wall / CPU time, peak above `base` (MiB), loss, trainable-gradient norm, CUDA reserved peak; the worker's "oom"
    result when one runs out of memory. The model in training mode, one micro-batch, as the training loop sets it."""
    import torch

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # read by the loss
    params = [p for p in model.parameters() if p.requires_grad]

    def step(name):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with mem.phase(name):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        rec = mem.records[-1]
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params if p.grad is not None]))
        return dict(ms=ms, cpu_ms=cpu_ms, peak=(rec.peak_bytes - base) / MIB, loss=loss.item(),
                    grad_norm=grad_norm.item(),
                    reserved=torch.cuda.max_memory_reserved() / MIB if cuda else None)

    from grpo_accel.offload.residency import HostMemoryError

    try:
        steps = [step("warmup")] + [step(f"step{i}") for i in range(reps)]
    except (torch.OutOfMemoryError, HostMemoryError) as exc:  # the GPU's limit, or the trainer's host budget
        return {"oom": True, "host_refused": isinstance(exc, HostMemoryError), "error": str(exc).splitlines()[0][:200]}
    return steps[1:] or steps


def run_worker(args, impl, mix):
    flags = harness.cli_flags(dict(mix=mix, arch=args.arch, device=args.device, num_generations=args.num_generations,
                                   prompt_length=args.prompt_length, completion_length=args.completion_length,
                                   reps=args.reps, offload=args.offload))
    return harness.run_worker(__file__, flags, impl, env=harness.step_env(args.device, args.offload == "true"),
                              label=mix)


def shape_of(args, mix):
    dtype = "bf16" if args.device == "cuda" else "fp32"
    return (f"{args.arch},lora-r16,G={args.num_generations},P<={args.prompt_length},T<={args.completion_length},"
            f"{mix},{dtype}" + (",offload" if args.offload == "true" else ""))


def rows_of(res, args, impl, mix):
    metrics = harness.failure_metrics(res)
    if not harness.failed(res):
        ms = statistics.median(res["time_ms"])
        metrics += [("step_time_ms", ms, "ms"), ("tokens_per_s", res["real_tokens"] / ms * 1e3, "tokens/s"),
                    ("peak_step_mem_mib", res["peak_mib"], "MiB"), ("real_tokens", res["real_tokens"], "tokens"),
                    ("padded_tokens", res["padded_tokens"], "tokens"), ("loss", res["loss"], "nats"),
                    ("lora_grad_norm", res["grad_norm"], "1"), ("load_1min", res["load_1min"], "procs")]
        if args.device == "cpu":
            cpu_ms = statistics.median(res["cpu_ms"])
            metrics += [("step_cpu_ms", cpu_ms, "ms"),
                        ("tokens_per_cpu_s", res["real_tokens"] / cpu_ms * 1e3, "tokens/s")]
        if "peak_reserved_mib" in res:
            metrics.append(("peak_reserved_mib", res["peak_reserved_mib"], "MiB"))
    return harness.long_rows("grpo_step_fwd_bwd", impl, shape_of(args, mix), metrics)


def plot(rows, path):
    harness.grouped_bars(rows, path, [("tokens_per_s", "real tokens / s (wall), one step fwd + bwd"),
                                      ("tokens_per_cpu_s", "real tokens / CPU-s (CPU rows)"),
                                      ("peak_step_mem_mib", "peak memory of one step above the model (MiB)")],
                         group=lambda r: (r["device"], r["shape"]), series=lambda r: r["impl"], order=list(VARIANTS),
                         sort=True, fmt="%.0f", title="one GRPO step, padded vs padding-free rows",
                         tick=lambda g: "\n".join([g[1].split(",")[5], g[1].split(",")[0], g[0].split(" (")[0][:24]]))


def parse_args(argv=None):
    p = harness.parser(__doc__, "packing.csv", worker=VARIANTS, device=True, resume=True)
    p.add_argument("--mix", choices=MIXES, help=argparse.SUPPRESS)
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    p.add_argument("--arch", default="smollm2-135m", help="a name from grpo_accel.planning.architectures")
    p.add_argument("--num-generations", type=int, default=8, help="G: rows in the step")
    p.add_argument("--prompt-length", type=int, default=64, help="P: longest prompt")
    p.add_argument("--completion-length", type=int, default=256, help="T: max completion tokens")
    p.add_argument("--reps", type=int, default=2, help="measured steps after the warm-up; time is their median")
    p.add_argument("--offload", default="false", choices=["true", "false"], help="offload_activations")
    return harness.parse(p, argv, worker)


def main(argv=None):
    args = parse_args(argv)
    run = harness.Results.of(args, ("torch", "trl", "transformers"), plot)
    for mix in args.mixes:
        results = {}
        for impl in VARIANTS:
            if not run.skip("grpo_step_fwd_bwd", impl, shape_of(args, mix), what=mix):
                results[impl] = run_worker(args, impl, mix)
                run.save(rows_of(results[impl], args, impl, mix))
        pad, pk = results.get("padded"), results.get("packed")
        if pad and pk and not any(harness.failed(r) for r in (pad, pk)):
            speed = statistics.median(pad["time_ms"]) / statistics.median(pk["time_ms"])
            cpu_speed = statistics.median(pad["cpu_ms"]) / statistics.median(pk["cpu_ms"])
            print(f"{mix}: real/padded tokens {pk['real_tokens']}/{pk['padded_tokens']}, packed step "
                  f"{speed:.2f}x faster (CPU time {cpu_speed:.2f}x), "
                  f"peak {pk['peak_mib'] / max(pad['peak_mib'], 1e-9):.2f}x of padded; "
                  f"loss {pad['loss']:.6g} vs {pk['loss']:.6g}, grad norm {pad['grad_norm']:.6g} vs "
                  f"{pk['grad_norm']:.6g}", flush=True)
    run.finish()


if __name__ == "__main__":
    harness.run(main)
