"""Worker for tests/test_qlora_multiprocess.py: QLoRA (a saved tiny-llama loaded 4-bit NF4 by bitsandbytes, LoRA on
every linear, fp32 adapters drawn at random) on 2 processes over gloo. Rank 0 writes, per run, the adapter grads
beside the reference computed before the spawn: the same global batch on one process, one forward, no wrapper.
Runs: "ddp" (torch DistributedDataParallel), "zero2", "zero3" (DeepSpeed engines; an engine that fails to start or
step is recorded as its error, not raised), "sp" (Ulysses SP = 2 on the GRPO trainer: log-probs, TRL's loss, adapter
grads averaged over the ranks, vs the same trainer without SP; each rank writes its own).

    python tests/workers/qlora_multiprocess_worker.py --model_dir DIR --runs ddp,zero2,sp,zero3 --out /tmp/qlora.pt
"""

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

ROWS, T = 4, 16  # 2 rows of 16 tokens per rank: equal token counts, so the ranks' mean loss is the batch's


def qlora_model(model_dir):
    from peft import LoraConfig, get_peft_model

    from grpo_accel.data.models import load_model

    model, _ = load_model(model_dir, quantization="4bit")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(7)  # as support.trainers.qlora_trainer: fp32, lora_B non-zero
    for _, p in sorted(model.named_parameters()):
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    return model.train()


def adapters(model):
    return {n.replace("module.", ""): p for n, p in model.named_parameters() if p.requires_grad}


def global_batch():
    return torch.randint(0, 1000, (ROWS, T), generator=torch.Generator().manual_seed(1))


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def reference(model_dir):
    model = qlora_model(model_dir)
    loss_of(model, global_batch()).backward()
    return {n: p.grad.clone() for n, p in adapters(model).items()}


def wrapped(engine, model_dir, rows):
    """(model to call, adapter grads after backward, backward) for `engine` around a fresh 4-bit model. The optimizer
    holds the adapters only, as transformers' Trainer builds it (the 4-bit base is frozen)."""
    import deepspeed

    model = qlora_model(model_dir)
    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, lambda: {n: p.grad.clone() for n, p in adapters(model).items()}, lambda loss: loss.backward()
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return ds, lambda: {n.replace("module.", ""): deepspeed.utils.safe_get_full_grad(p).clone()
                        for n, p in ds.module.named_parameters() if p.requires_grad}, ds.backward


def engine_run(engine, model_dir, rank, world):
    ids = global_batch().chunk(world)[rank]
    try:
        model, full_grads, backward = wrapped(engine, model_dir, ids.shape[0])
        backward(loss_of(model, ids))
        four_bit = [p for p in model.parameters() if p.dtype == torch.uint8]
        # ZeRO-3: how many 4-bit weights this rank holds only a partition of (its ds_tensor; .data empty)
        partitioned = sum(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in four_bit)
        return {"grads": full_grads(), "four_bit": len(four_bit), "partitioned": partitioned}
    except Exception as exc:  # recorded for the test to show (ZeRO-3 may not partition 4-bit weights)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def sp_run(model_dir, world, reference_only=False):
    """The GRPO trainer on the 4-bit model (support.trainers.qlora_trainer), padded rows, with and without SP."""
    from support.trainers import qlora_trainer, run_hook, unequal_batch

    from grpo_accel.parallel import sequence_parallel

    trainer = qlora_trainer(Path(tempfile.mkdtemp()), model_dir)
    inputs = unequal_batch(trainer)  # generated alike on both ranks (same seeds, one thread)
    # the tiny model's rewards tie within a group (advantages 0): fixed non-zero advantages instead
    inputs["advantages"] = torch.linspace(-1.0, 1.5, inputs["advantages"].numel()).view_as(inputs["advantages"])
    ref = run_hook(trainer, inputs, padding_free=False)
    trainer.sequence_parallel = sequence_parallel.enable(world, **trainer.sequence_parallel_arguments())
    calls, real = [], trainer.sequence_parallel.logps_and_entropies
    trainer.sequence_parallel.logps_and_entropies = lambda *a, **k: calls.append(1) or real(*a, **k)
    lp, ent, loss, grads = run_hook(trainer, inputs, padding_free=False)
    trainer.sequence_parallel.remove()
    for g in grads.values():  # the data-parallel engine's mean over the ranks
        torch.distributed.all_reduce(g)
        g /= world
    return {"ref": ref, "sp": (lp, ent, loss, grads), "sp_calls": len(calls), "mask": inputs["completion_mask"]}


def rank_main(rank, world, runs, model_dir, out, port, refs):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from grpo_accel._compat.cpu_distributed import prepare_cpu_processes

    prepare_cpu_processes()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for run in runs:  # ZeRO-3 last: its engine converts the model's parameters in place
        result[run] = sp_run(model_dir, world) if run == "sp" else engine_run(run, model_dir, rank, world)
        if run != "sp":
            result[run]["reference"] = refs
    torch.save(result, f"{out}.rank{rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # gloo's threads joined before exit (else an occasional SIGABRT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True, help="a saved tiny model (save_pretrained of model and tokenizer)")
    ap.add_argument("--runs", default="ddp,zero2,sp,zero3")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29531)
    a = ap.parse_args()
    runs = sorted(a.runs.split(","), key=lambda r: r == "zero3")
    refs = reference(a.model_dir) if set(runs) - {"sp"} else None
    mp.spawn(rank_main, args=(2, runs, a.model_dir, a.out, a.port, refs), nprocs=2)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # the stack's teardown is seconds of a core per process
