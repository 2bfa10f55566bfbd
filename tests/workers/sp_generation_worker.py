"""Worker for tests/test_sequence_parallel.py::test_sp_group_samples_like_single_processes: two processes form one
SP group and call `SequenceParallel.generate_once` for 3 steps with a real sampling generate() of a tiny Llama
(multinomial draws on torch's RNG), each process seeded as TRL seeds it (seed + process index); between steps each
process draws dropout-like random numbers as training does. Rank r writes what it generated and, as the reference,
what one process seeded with seed + r generates from the same prompts over the same steps, with nothing in between.

    python tests/workers/sp_generation_worker.py --out /tmp/gen.pt --port 29533
"""

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
SEED, STEPS, PROMPTS = 7, 3, 4  # 4 copies of one prompt per step (a GRPO group): 2 per rank


def model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def generator(lm):
    def generate(prompts):  # TRL's _generate returns a tuple; here (completion token lists,)
        ids = torch.tensor(prompts)
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=6, top_k=0,
                          pad_token_id=0)
        return ([row[ids.shape[1]:].tolist() for row in out],)

    return generate


def prompts_of(step):
    return [[1, 5 + step, 9, 3]] * PROMPTS


def rank_main(rank, world, out, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from grpo_accel._compat.cpu_distributed import prepare_cpu_processes
    from grpo_accel.parallel.sequence_parallel import SequenceParallel

    lm = model()
    torch.manual_seed(SEED + rank)  # the reference: one process, rank r's share of every step's prompts
    k = PROMPTS // world
    reference = [generator(lm)(prompts_of(s)[rank * k:(rank + 1) * k])[0] for s in range(STEPS)]

    prepare_cpu_processes()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    sp = SequenceParallel.__new__(SequenceParallel)  # only the generation part: no model patches needed
    sp.sp, sp.group, sp.rank = world, torch.distributed.group.WORLD, rank
    torch.manual_seed(SEED + rank)  # TRL: set_seed(args.seed, device_specific=True)
    steps, after = [], []
    for s in range(STEPS):
        steps.append(sp.generate_once(generator(lm), prompts_of(s))[0])
        after.append(torch.rand(3))  # what the group draws next (TRL's shuffle, dropout): equal on every rank
        torch.rand(5 + 7 * rank)  # training draws that differ per rank (e.g. another micro-batch's dropout)
    torch.save({"steps": steps, "after": after, "reference": reference}, f"{out}.rank{rank}")
    torch.distributed.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(rank_main, args=(2, args.out, args.port), nprocs=2, join=True)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # the stack's teardown is seconds of a core per process
