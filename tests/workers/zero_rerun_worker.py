"""Worker for tests/test_offload_multiprocess.py: one layer-offloaded tiny Llama on 2 processes over gloo, under a
DeepSpeed ZeRO engine ("zero2", "zero3") or torch DistributedDataParallel ("ddp"); rank 0 writes the full gradients
beside the reference: the same global batch on one process, one forward, no wrapper (computed before the spawn).
Modes: the re-run in row groups ("grouped"), in sequence tiles ("tiled"), and several forwards before one backward
("several": each rank's rows in 2 mini-batches, in row groups, their losses summed to the one-forward loss); "lora"
(grouped, LoRA adapters on a frozen base); "bf16" / "fp16" (grouped in half precision as each engine runs it: DDP
under autocast over fp32 weights, as accelerate's mixed precision does; DeepSpeed with its bf16 / fp16 config,
which casts the weights, fp16 at a static loss scale of 1 so the grads compare unscaled). A half run's reference is
the same half computation on one process, and its fp32 twin (`fp32`) sets the tolerance.

    python tests/workers/zero_rerun_worker.py --runs zero2:grouped,zero3:several --out /tmp/grads.pt
    ZERO_RERUN_DEVICE=cuda python tests/workers/zero_rerun_worker.py --world 1 --runs zero2:fp16,zero3:fp16 \
        --out /tmp/g.pt
"""

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# grouped: 4 rows of T tokens, recompute_tokens = T -> one row per group (2 groups per rank on 2 processes);
# tiled: 2 rows of 4*TILE tokens -> each rank's row runs in 4 tiles;
# several: 8 rows of T tokens -> 2 forwards of 2 rows per rank, each re-run in 2 row groups.
T, TILE, FORWARDS = 16, 8, 2


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


DEVICE = os.environ.get("ZERO_RERUN_DEVICE", "cpu")  # "cuda": 1 GPU per rank over NCCL (the GPU-only fp16 runs)


def batch(mode):
    g = torch.Generator().manual_seed(1)
    rows, length = {"tiled": (2, 4 * TILE), "several": (8, T)}.get(mode, (4, T))
    return torch.randint(0, 96, (rows, length), generator=g).to(DEVICE)


def model_and_offload(mode, cast=None):
    import transformers

    from grpo_accel.offload import OffloadConfig, install_activation_offload

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    if mode == "lora":  # adapters on every linear with random B, so every adapter weight gets a gradient
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.to(DEVICE)
    if cast is not None:
        model.to(cast)
    install_activation_offload(model, OffloadConfig(recompute_tokens=TILE if mode == "tiled" else T,
                                                    device_copies=True, use_streams=False, pin_memory=False,
                                                    min_bytes=0))
    return model


def loss_of(model, ids, autocast=None):
    with torch.autocast(DEVICE, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return model(input_ids=ids, labels=ids).loss  # mean over equal token counts: the ranks' mean is the batch's


def how(run):
    """(weights cast to, autocast dtype) of a run: DeepSpeed casts the weights, DDP autocasts over fp32."""
    engine, mode = run.split(":")
    half = HALF.get(mode)
    return (half, None) if engine.startswith("zero") else (None, half)


def reference(run):
    """Full grads of the run's computation on one process, one forward, no wrapper; half runs also in fp32."""
    mode = run.split(":")[1]
    cast, autocast = how(run)
    model = model_and_offload(mode, cast)
    loss_of(model, batch(mode), autocast).backward()
    out = {"grads": {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}}
    if mode in HALF:
        model = model_and_offload(mode)
        loss_of(model, batch(mode)).backward()
        out["fp32"] = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return out


def wrapped(engine, mode, rows):
    """(model to call, full grads after backward, backward) for `engine` around a fresh model."""
    import deepspeed

    model = model_and_offload(mode)  # DeepSpeed casts to its half dtype itself
    trainable = [p for p in model.parameters() if p.requires_grad]
    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, lambda: {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}, \
            lambda loss: loss.backward()
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    if mode == "bf16":
        config["bf16"] = {"enabled": True}
    elif mode == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 1.0}
    ds, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=0.0), config=config)
    return ds, lambda: {n: deepspeed.utils.safe_get_full_grad(p).float().cpu()
                        for n, p in ds.module.named_parameters() if p.requires_grad}, ds.backward


def rank_main(rank, world, runs, out, port, refs):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from grpo_accel._compat.cpu_distributed import prepare_cpu_processes

    prepare_cpu_processes()
    import deepspeed

    from grpo_accel.offload import rerun

    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    returned = []  # per layer backward: were its parameter grads returned as the checkpoint Function's outputs
    real = getattr(rerun, "param_aliases", None)
    if real is not None:
        rerun.param_aliases = lambda module, params: (returned.append(bool(params)), real(module, params))[1]
    result = {}
    for run in runs:  # ZeRO-3 last: its engine converts the model's parameters in place
        engine, mode = run.split(":")
        ids = batch(mode).chunk(world)[rank]
        model, full_grads, backward = wrapped(engine, mode, ids.shape[0])
        returned.clear()
        pieces = ids.chunk(FORWARDS) if mode == "several" else [ids]
        autocast = how(run)[1]
        backward(sum(loss_of(model, p, autocast) for p in pieces) / len(pieces))
        result[run] = {"grads": full_grads(), "reference": refs[run], "returned": sum(returned)}
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # gloo's threads joined before exit (else an occasional SIGABRT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--runs", default="zero2:grouped,zero2:tiled", help="comma-separated engine:mode")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29511)
    a = ap.parse_args()
    runs = sorted(a.runs.split(","), key=lambda r: r.startswith("zero3"))
    refs = {run: reference(run) for run in runs}
    mp.spawn(rank_main, args=(a.world, runs, a.out, a.port, refs), nprocs=a.world)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # the stack's teardown is seconds of a core per process
