"""Worker for tests/test_sequence_parallel.py: each of 2 processes builds the same tiny-llama LoRA trainer and the same
batch (completions of unequal length), computes log-probs, TRL's loss and LoRA grads alone (the reference: one
process, no SP); then, over gloo, the same with Ulysses SP = 2 (the group-shared layout: each row split along T
between the two). The SP grads are averaged over the ranks, as the data-parallel engine does. tiny-llama's are measured
again under bf16 and fp16 CPU autocast (`half`). Each case (a model, `:full` for full fine-tuning) runs in turn in the
same two processes (one start-up for all: ~35 s of imports per launch on the 2-core CI machine), its trainer closed and
SP removed before the next; each rank writes OUT.MODEL.rankR.

    python tests/workers/sequence_parallel_worker.py --out /tmp/sp.pt [--offload] --cases tiny-llama tiny-gpt-oss:full
"""

import argparse
import gc
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def base_model(trainer):
    """The causal LM under PEFT's wrapper (the model itself under full fine-tuning)."""
    return getattr(trainer.model, "get_base_model", lambda: trainer.model)()


def rank_main(rank, world, out, port, offload, cases):
    torch.set_num_threads(1)
    for case in cases:
        model, _, full = case.partition(":")
        run_case(rank, world, f"{out}.{model}.rank{rank}", port, offload, model, full == "full")
        gc.collect()  # the case's trainer goes, and its patches with it, before the next one builds its own


def run_case(rank, world, out, port, offload, model, full):
    import tempfile

    from support.trainers import grads_of, make_trainer, one_batch

    from grpo_accel._compat.cpu_distributed import prepare_cpu_processes
    from grpo_accel.parallel import sequence_parallel
    from grpo_accel.trainer.savers import FORCE_OFFLOAD_COPIES_ENV

    os.environ[FORCE_OFFLOAD_COPIES_ENV] = "1" if offload else "0"
    from pathlib import Path

    # gradient checkpointing with offload: the layers' re-run in backward goes through Ulysses again, in sequence
    # tiles of 8 tokens on each shard
    extra = dict(offload_activations="true", gradient_checkpointing=True, offload_recompute_tokens=8) if offload \
        else {}
    if model != "tiny-llama":  # a MoE twin: without the router loss, which SP refuses (trainer.py)
        extra["router_aux_loss_coef"] = 0.0
    # test_trainer_parity's trainer: 4 rows
    trainer = make_trainer(Path(tempfile.mkdtemp()), model, peft=not full, rows=4, logprob_impl="chunked", **extra)
    torch.manual_seed(2)  # LoRA B starts at 0 (A's grads would be 0): give every adapter weight a value
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    inputs = one_batch(trainer)
    B = inputs["completion_mask"].shape[0]
    # completions of unequal length (right padding, as TRL masks after EOS)
    for i in range(B):
        inputs["completion_mask"][i, inputs["completion_mask"].shape[1] - 2 * i - 1:] = 0
    # the tiny model's rewards tie within a group (advantages 0, no gradient): fixed non-zero advantages instead
    inputs["advantages"] = torch.linspace(-1.0, 1.5, inputs["advantages"].numel()).view_as(inputs["advantages"])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    k = inputs["completion_ids"].size(1)

    def measure(dtype=None):
        """fp32, or under CPU autocast in `dtype` (the trainer's bf16 / fp16 mixed precision over fp32 weights)."""
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            with torch.no_grad():
                lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k,
                                                                        compute_entropy=True)
            loss, grads = grads_of(trainer, inputs)
        return {"logps": lp.float(), "entropy": ent.float(), "loss": loss.float(), "grads": grads}

    half = HALF if model == "tiny-llama" else {}
    ref = measure()
    ref["half"] = {name: measure(dtype) for name, dtype in half.items()}
    if not torch.distributed.is_initialized():  # the first case's reference ran alone, as every later one does
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        prepare_cpu_processes()
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registry_before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    trainer.sequence_parallel = sequence_parallel.enable(world, **trainer.sequence_parallel_arguments())
    calls, shards, shard_rows = [], [], []
    sp_obj = trainer.sequence_parallel
    real, attend = sp_obj.logps_and_entropies, sp_obj.uattn.forward
    sp_obj.logps_and_entropies = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    sp_obj.uattn.forward = lambda module, q, *a, **k: (shards.append(q.shape[2]), shard_rows.append(q.shape[0]),
                                                             attend(module, q, *a, **k))[-1]
    from grpo_accel.parallel import ulysses_tiles as tiled_sp

    layer_tiles, tiled_backward = [], tiled_sp.backward  # each layer's re-run in sequence tiles on the shard
    tiled_sp.backward = lambda run, x, g, tiles, group: (layer_tiles.append(len(tiles)),
                                                         tiled_backward(run, x, g, tiles, group))[-1]
    sp = measure()
    sp["sp_calls"], sp["shard_lengths"], sp["shard_rows"] = len(calls), list(shards), list(shard_rows)
    sp["layer_tiles"] = list(layer_tiles)
    sp["half"] = {name: measure(dtype) for name, dtype in half.items()}  # after the counts above: they are fp32's
    sp["sdpa_patched"] = dict(ALL_ATTENTION_FUNCTIONS._local_mapping) != registry_before
    sp["sp_head_installed"] = getattr(base_model(trainer).forward, "accel_labels_kwarg", None) == \
        "accel_sp_targets"
    sp_obj.remove()  # what the trainer's close() runs: transformers' registry and the models' forwards as before
    sp["sdpa_after_remove"] = dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == registry_before
    sp["sp_head_after_remove"] = getattr(base_model(trainer).forward, "accel_labels_kwarg", None) == \
        "accel_sp_targets"
    for g in [*sp["grads"].values(), *(g for h in sp["half"].values() for g in h["grads"].values())]:
        torch.distributed.all_reduce(g)  # the data-parallel engine's mean over the ranks
        g /= world
    tiled_sp.backward = tiled_backward
    torch.save({"ref": ref, "sp": sp, "mask": inputs["completion_mask"], "row_tokens": mask.sum(1)}, out)
    torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29523)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--cases", nargs="+", default=["tiny-llama"],
                    help="models in turn; MODEL:full for full fine-tuning (gpt-oss: its sinks get gradients)")
    a = ap.parse_args()
    mp.spawn(rank_main, args=(2, a.out, a.port, a.offload, a.cases), nprocs=2)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # the stack's teardown is seconds of a core per process
