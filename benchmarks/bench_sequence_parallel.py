"""One GRPO loss step (policy forward + backward, no generation) on one long row: the row whole on one process
(`sp1`) against Ulysses SP = 2 over gloo (`sp2`: both processes hold the row, each runs half of its tokens), memory
per process and time. What the group-shared layout (grpo_accel/parallel/sequence_parallel.py) is for: per-GPU memory
that falls with the group's size.

    # CPU: SmolLM2-135M shape with 8 heads (its 9 do not split 2 ways), LoRA r=16, fp32, offload + checkpointing,
    # one row of 64 prompt + 4096 completion tokens, re-run pieces of 1024 tokens (~6 min on 2 cores)
    OMP_NUM_THREADS=1 python benchmarks/bench_sequence_parallel.py --completion-length 4096

Same seed, same LoRA init, same row in both variants, so loss and LoRA grad norm must agree (the grad norm of
`sp2` is the engine's: the two processes' grads averaged, as DDP / ZeRO average them). Each variant runs in fresh
processes. Metrics per process: peak_step_mem_mib (peak RSS above the built model, CPU VmHWM with a fixed glibc mmap
threshold as in bench_step_memory.py; on CUDA max_memory_allocated), step_time_ms, and for sp2 the larger of the
two processes. Writes benchmarks/results/sequence_parallel.csv (+ .png). CPU processes have no separate device
memory: "offload" copies layer inputs within the same RAM, so the figure is everything the step holds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import MIB

VARIANTS = {"sp1": 1, "sp2": 2}


def build_trainer(a, tmp):
    import torch
    from bench_step_memory import enable_checkpointing_like_train, synthetic_tokenizer
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpo_accel.planning.architectures import get_architecture
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    config = get_architecture(a.arch)
    config.use_cache = False
    config.num_attention_heads, config.num_key_value_heads = a.heads, a.kv_heads
    config.head_dim = config.hidden_size // a.heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args = GRPOAccelConfig(output_dir=tmp, per_device_train_batch_size=2, num_generations=2,
                           max_completion_length=a.completion_length, report_to="none", bf16=False, use_cpu=True,
                           seed=0, offload_activations="true", gradient_checkpointing=True,
                           offload_recompute_tokens=a.recompute_tokens, logprob_impl="chunked")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOAccelTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                               args=args, processing_class=synthetic_tokenizer(),
                               train_dataset=Dataset.from_dict({"prompt": ["x"] * 2}), peft_config=lora)
    enable_checkpointing_like_train(trainer)
    return trainer


def make_inputs(P: int, T: int, V: int):
    """One row in TRL's layout, every token real; a fixed non-zero advantage and old log-probs."""
    import torch

    g = torch.Generator().manual_seed(1)
    return dict(prompt_ids=torch.randint(3, V, (1, P), generator=g), prompt_mask=torch.ones(1, P, dtype=torch.long),
                completion_ids=torch.randint(3, V, (1, T), generator=g),
                completion_mask=torch.ones(1, T, dtype=torch.long), advantages=torch.tensor([1.0]),
                old_per_token_logps=torch.full((1, T), -math.log(V)), num_items_in_batch=torch.tensor(T))


def rank_main(rank, world, a, port, out_dir):
    """One process: build, (SP: join the group), one step; writes its result to out_dir/rank{rank}.json."""
    import torch

    torch.set_num_threads(1)
    from grpo_accel.core.phase_memory import PhaseMemory

    mem = PhaseMemory("cpu")
    with tempfile.TemporaryDirectory() as tmp, mem.phase("load"):
        trainer = build_trainer(a, tmp)
        if world > 1:
            from grpo_accel._compat.cpu_distributed import prepare_cpu_processes
            from grpo_accel.parallel import sequence_parallel

            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            prepare_cpu_processes()
            torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
            trainer.sequence_parallel = sequence_parallel.enable(world, **trainer.sequence_parallel_arguments())
    base = mem.records[-1].end_bytes
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = make_inputs(a.prompt_length, a.completion_length, model.config.get_text_config().vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    with mem.phase("step"):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    grads = torch.cat([p.grad.flatten() for p in params])
    if world > 1:  # the engine's mean over the processes
        torch.distributed.all_reduce(grads)
        grads /= world
    result = dict(rank=rank, ms=ms, cpu_ms=cpu_ms, peak_mib=(mem.records[-1].peak_bytes - base) / MIB,
                  base_mib=base / MIB, loss=loss.item(), grad_norm=grads.norm().item())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        torch.distributed.barrier()


def worker(a) -> dict:
    """The variant's processes (sp2: two, spawned here), one step each; their results, rank by rank."""
    import torch.multiprocessing as mp
    from campaign.serve import free_port

    world = VARIANTS[a.worker]
    with tempfile.TemporaryDirectory() as out_dir:
        if world == 1:
            rank_main(0, 1, a, 0, out_dir)
        else:
            mp.spawn(rank_main, args=(world, a, free_port(), out_dir), nprocs=world)
        return {"ranks": [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]}


def rows_of(results, args, impl):
    shape = (f"{args.arch}-{args.heads}heads,lora-r16,1 row,P={args.prompt_length},T={args.completion_length},fp32,"
             f"offload,pieces={args.recompute_tokens}")
    worst = max(results, key=lambda r: r["peak_mib"])
    metrics = [("peak_step_mem_mib", worst["peak_mib"], "MiB"), ("step_time_ms", max(r["ms"] for r in results), "ms"),
               ("step_cpu_ms", max(r["cpu_ms"] for r in results), "ms"), ("model_mib", worst["base_mib"], "MiB"),
               ("processes", len(results), "1"), ("loss", results[0]["loss"], "nats"),
               ("lora_grad_norm", results[0]["grad_norm"], "1")]
    return harness.long_rows("grpo_step_fwd_bwd", impl, shape, metrics)


def plot(rows, path):
    harness.grouped_bars(rows, path, [("peak_step_mem_mib", "peak step memory per process above the model (MiB)"),
                                      ("step_time_ms", "step time (ms, slowest process)")],
                         group=lambda r: r["shape"], series=lambda r: r["impl"], order=list(VARIANTS), sort=True,
                         tick=lambda shape: shape.split(",")[4], fmt="%.0f",
                         title="one long row: whole on one process vs Ulysses SP = 2 (gloo)")


def parse_args(argv=None):
    p = harness.parser(__doc__, "sequence_parallel.csv", worker=VARIANTS)
    p.add_argument("--arch", default="smollm2-135m", help="a name from grpo_accel.planning.architectures")
    p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by 2)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--completion-length", type=int, default=4096)
    p.add_argument("--recompute-tokens", type=int, default=1024, help="offload_recompute_tokens (re-run pieces)")
    return harness.parse(p, argv, worker)


def main(argv=None):
    args = parse_args(argv)
    flags = sys.argv[1:] if argv is None else argv  # a worker runs with the parent's flags and its --worker
    meta = harness.run_meta("cpu", ("torch", "trl", "transformers", "deepspeed"))
    env = harness.step_env("cpu", offload=True)
    results = {impl: harness.run_worker(__file__, flags, impl, env=env)["ranks"] for impl in VARIANTS}
    rows = [row for impl, res in results.items() for row in rows_of(res, args, impl)]
    one, two = results["sp1"][0], max(results["sp2"], key=lambda r: r["peak_mib"])
    print(f"peak per process: sp1 {one['peak_mib']:.0f} MiB, sp2 {two['peak_mib']:.0f} MiB "
          f"({two['peak_mib'] / one['peak_mib']:.2f}x); step {one['ms']:.0f} vs "
          f"{max(r['ms'] for r in results['sp2']):.0f} ms; loss {one['loss']:.6g} vs {results['sp2'][0]['loss']:.6g}, "
          f"grad norm {one['grad_norm']:.6g} vs {results['sp2'][0]['grad_norm']:.6g}", flush=True)
    harness.write_results(rows, args.out, meta, plot)


if __name__ == "__main__":
    harness.run(main)
