"""The generation server's own machine, for route `vllm_server` (issue 52, item 6): the training plan holds nothing
of generation there (memory.plan_memory), so the server is sized here, apart.

Two servers run: for a LoRA or QLoRA run, `vllm serve` with adapters loaded at run time (server_generation.py: the
base in the compute dtype stays put, each step's adapter is loaded beside it, `max_staleness + 1` of them at once);
for full fine-tuning, TRL 1.16's `trl vllm-serve` (every weight pushed over NCCL each step). Either holds the whole
model in the compute dtype (a QLoRA run's server holds bf16 weights, not NF4), with vLLM's own runtime and a paged KV
cache in what `--gpu_memory_utilization` leaves (a LoRA server's adapter slots, max_loras x rank x the targets' widths,
are MBs: not planned). A
sequence takes pages as it grows, so the pool bounds how many *full-length* sequences decode at once; shorter ones
fit more. The plan: the fewest GPUs (vLLM's tensor parallelism: 1, 2, 4, 8, and no more than the model's KV heads)
whose pool holds the step's whole generation batch at full length at once; where none does, the most (the fewest
sequences wait in vLLM's queue: time, not memory), if their pool holds one full-length sequence (vLLM refuses to
start below that). Terms as memory.py prices them (weights_bytes, ModelShape.kv_cache_bytes, VLLM_RUNTIME_BYTES
per GPU); vLLM splits weights and KV heads evenly over tensor-parallel ranks, and each rank has its own runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_accel.core.dtypes import dtype_bytes, long_name
from grpo_accel.core.units import GIB
from grpo_accel.planning.architectures import ModelShape
from grpo_accel.planning.generation import VLLM_RUNTIME_BYTES
from grpo_accel.planning.memory import weights_bytes

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)  # one node's GPUs; past 8 a server spans nodes (not planned)
SERVER_MEMORY_UTILIZATION = 0.9  # `trl vllm-serve --gpu_memory_utilization`'s default


@dataclass
class ServerPlan:
    model: str
    tensor_parallel_size: int  # 0: no size up to 8 GPUs holds one full-length sequence
    gpu_bytes: int
    weights_bytes: int  # the whole model, all ranks together
    runtime_bytes: int  # all ranks together
    kv_bytes_per_sequence: int  # one full-length sequence (prompt + completion), all ranks together
    max_model_len: int
    sequences_at_once: int  # full-length sequences the pool holds at once
    generation_batch: int  # sequences the server is asked for per generation (all trainer processes)
    dtype: str = "bfloat16"  # as vLLM's --dtype names it
    utilization: float = SERVER_MEMORY_UTILIZATION
    lora_r: int = 0  # > 0: adapters loaded at run time (`vllm serve`); 0: full fine-tuning (`trl vllm-serve`)
    max_loras: int = 2  # adapters held at once: the version training and those sampling ahead (max_staleness + 1)

    @property
    def fits(self) -> bool:
        return self.tensor_parallel_size > 0

    def command(self) -> str:
        """What the server machine runs: `vllm serve` taking adapters at run time for a LoRA run (the key from the
        environment the trainer reads it from), TRL's own `vllm-serve` for full fine-tuning."""
        if self.lora_r:
            return lora_serve_command(
                self.model, self.max_loras, self.lora_r,
                before=(f"--tensor-parallel-size {self.tensor_parallel_size}", f"--max-model-len {self.max_model_len}",
                        f"--gpu-memory-utilization {self.utilization}", f"--dtype {self.dtype}"),
                after=("--logprobs-mode processed_logprobs", "--api-key $GRPO_ACCEL_VLLM_API_KEY"))
        return (f"trl vllm-serve --model {self.model} --tensor_parallel_size {self.tensor_parallel_size} "
                f"--max_model_len {self.max_model_len} --gpu_memory_utilization {self.utilization} "
                f"--dtype {self.dtype}")

    def format(self) -> str:
        gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        if not self.fits:
            return (f"vLLM server: no tensor-parallel size up to {TENSOR_PARALLEL_SIZES[-1]} GPUs of "
                    f"{gib(self.gpu_bytes)} holds one full-length sequence ({gib(self.kv_bytes_per_sequence)} of KV "
                    f"cache beside {gib(self.weights_bytes)} of weights): shorten --max_completion_length")
        queued = max(0, self.generation_batch - self.sequences_at_once)
        return (f"vLLM server (its own machine): {self.tensor_parallel_size} GPU(s) of {gib(self.gpu_bytes)}, "
                f"weights {gib(self.weights_bytes)} ({self.dtype}, split over the GPUs), runtime "
                f"{gib(self.runtime_bytes)}, KV cache {gib(self.kv_bytes_per_sequence)} per full-length sequence of "
                f"{self.max_model_len} tokens: {self.sequences_at_once} full-length sequences at once of the "
                f"{self.generation_batch} asked per generation"
                + (f" ({queued} wait in vLLM's queue while the pool is full)" if queued else "")
                + f"\nserver command: {self.command()}")


def lora_serve_command(model, max_loras, max_lora_rank, before=(), after=()) -> str:
    """`vllm serve` loading LoRA adapters at run time, the one spelling: the plan prints it (`before` / `after`: its
    other flags), and a trainer that cannot reach its server names it (generation/adapter_sync.py)."""
    return " ".join(["VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve", str(model), *before, "--enable-lora",
                     f"--max-loras {max_loras}", f"--max-lora-rank {max_lora_rank}", *after])


def plan_server(shape: ModelShape, *, model: str, max_model_len: int, generation_batch: int, gpu_bytes: int,
                dtype: str = "bf16", utilization: float = SERVER_MEMORY_UTILIZATION, lora_r: int = 0,
                max_staleness: int = 1) -> ServerPlan:
    """The server for `generation_batch` sequences of up to `max_model_len` tokens on GPUs of `gpu_bytes`, serving
    in `dtype` (the run's compute dtype, any spelling: the command names it as vLLM does); `lora_r` > 0 plans the
    adapter server (server_generation.py), 0 TRL's."""
    a = dtype_bytes(dtype)
    weights = int(weights_bytes(shape, a, "none"))  # TRL pushes merged full weights: never quantized
    per_seq = shape.kv_cache_bytes(max_model_len, a)
    held = {}  # tensor-parallel size -> full-length sequences its pool holds at once
    for tp in TENSOR_PARALLEL_SIZES:
        if tp > max(1, shape.kv_heads):  # vLLM splits KV heads over ranks (replicates below one per rank: not planned)
            break
        held[tp] = max(0, int((tp * (utilization * gpu_bytes - VLLM_RUNTIME_BYTES) - weights) // per_seq))
    # the fewest GPUs that decode the whole batch at once; else the most (fewest sequences queued), if one fits
    tp = next((t for t, n in held.items() if n >= generation_batch), max(held))
    if held[tp] < 1:
        return ServerPlan(model, 0, gpu_bytes, weights, 0, per_seq, max_model_len, 0, generation_batch,
                          long_name(dtype), utilization, lora_r, max_staleness + 1)
    return ServerPlan(model, tp, gpu_bytes, weights, tp * VLLM_RUNTIME_BYTES, per_seq, max_model_len, held[tp],
                      generation_batch, long_name(dtype), utilization, lora_r, max_staleness + 1)

__all__ = ["SERVER_MEMORY_UTILIZATION", "ServerPlan", "TENSOR_PARALLEL_SIZES", "plan_server"]
