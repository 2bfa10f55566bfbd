"""Worker for tests/test_offload_multiprocess.py: one layer-offloaded tiny Llama under a 2-process DeepSpeed ZeRO
engine over gloo, its re-run in row groups ("grouped") and in sequence tiles ("tiled"); rank 0 writes the full
gradients beside the reference: the same batch on one process without DeepSpeed (computed before the spawn).

    python tests/zero_rerun_worker.py --stage 2 --out /tmp/grads.pt
"""

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# grouped: 4 rows of T tokens, recompute_tokens = T -> one row per group (2 groups per rank on 2 processes);
# tiled: 2 rows of 4*TILE tokens -> each rank's row runs in 4 tiles.
T, TILE = 16, 8


def batch(mode):
    g = torch.Generator().manual_seed(1)
    rows, length = (4, T) if mode == "grouped" else (2, 4 * TILE)
    return torch.randint(0, 96, (rows, length), generator=g)


def model_and_offload(mode):
    import transformers

    from grpo_accel.offload import OffloadConfig, install_activation_offload

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    install_activation_offload(model, OffloadConfig(recompute_tokens=T if mode == "grouped" else TILE,
                                                    device_copies=True, use_streams=False, pin_memory=False,
                                                    min_bytes=0))
    return model


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss  # mean over equal token counts: the ranks' mean is the batch's


def reference(mode):
    model = model_and_offload(mode)
    loss_of(model, batch(mode)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def rank_main(rank, world, stage, out, port, refs):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from grpo_accel.cpu_distributed import prepare_cpu_processes

    prepare_cpu_processes()
    import deepspeed

    from grpo_accel.offload import rerun

    deepspeed.init_distributed(dist_backend="gloo")
    deferred = []  # per layer backward: were the parameter grads handed back once (pieces under several processes)
    real = rerun.deferred_param_grads
    rerun.deferred_param_grads = lambda module, enabled=True: (deferred.append(enabled), real(module, enabled))[1]
    result = {}
    for mode, ref in refs.items():
        model = model_and_offload(mode)
        ids = batch(mode).chunk(world)[rank]
        config = {"train_micro_batch_size_per_gpu": ids.shape[0], "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=config)
        deferred.clear()
        engine.backward(loss_of(engine, ids))
        grads = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        result[mode] = {"grads": grads, "reference": ref, "deferred": sum(deferred)}
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29511)
    a = ap.parse_args()
    refs = {mode: reference(mode) for mode in ("grouped", "tiled")}
    mp.spawn(rank_main, args=(a.world, a.stage, a.out, a.port, refs), nprocs=a.world)


if __name__ == "__main__":
    main()
