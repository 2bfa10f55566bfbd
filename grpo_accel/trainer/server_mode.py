"""Server mode with a LoRA adapter, the trainer's side (issue 52): the `vllm serve` machine as TRL's
`vllm_generation`, the next generation batch read one optimizer step early and asked for while this step trains.
The server client itself (sync, sampling, staleness, errors) is generation/server_generation.py."""

from __future__ import annotations

import copy
import os

from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError
from grpo_accel.generation.adapter_sync import base_dtype
from grpo_accel.generation.server_generation import ServerGeneration
from grpo_accel.generation.vllm_generation import sampling_options
from grpo_accel.trainer.generation_modes import GenerationMode, ReadAhead, attach_to_trl, refuse_multi_turn


class ServerMode(GenerationMode):
    """Generation on a `vllm serve` machine with adapter-only sync; with max_staleness >= 1 the next batch is
    asked for once this one is in hand, sampled with this step's adapter while this step trains."""

    routing_blocker = ("a vLLM server's routing is not recorded yet (vLLM's enable_return_routed_experts is not "
                       "wired in); --use_vllm false --use_transformers_continuous_batching true records it")

    def __init__(self, trainer):
        self.generation = attach_server(trainer)
        self.read_ahead = ReadAhead() if trainer.args.max_staleness >= 1 else None

    def refill_and_score(self, trainer, inputs: list[dict], score):
        """Dynamic sampling's refill round: sampled now, with this step's adapter; the batch asked for ahead stays
        queued for the step it is for."""
        with self.generation.sampled_now():
            return score(inputs)

    def after_single_turn(self, trainer, num_generations: int) -> None:
        """Every rank, once this step's batch is in hand: its share of the next generation batch goes to the
        server."""
        rows = self.read_ahead.take_next_rows() if self.read_ahead is not None else None
        if rows is None:  # None on every rank alike: the epoch's last batch (the ranks read in lockstep)
            return
        sp = getattr(trainer, "sequence_parallel", None)
        if sp is not None:  # this rank's piece, as generate_once splits the group's batch (untested: a wrong split
            k = len(rows) // sp.sp  # costs the overlap, counted as dropped, never a wrong row)
            rows = rows[sp.rank * k:(sp.rank + 1) * k]
        ahead_ids = trainer._tokenize_prompts(copy.deepcopy([row["prompt"] for row in rows]))[0]
        self.generation.submit(ahead_ids, num_generations)

    def metrics(self) -> dict:
        return self.generation.metrics()

    def close(self) -> None:
        self.generation.close()  # batches asked for ahead: nobody will train on them


def attach_server(trainer) -> ServerGeneration:
    """Route a TRL 1.16 GRPOTrainer's generation to a `vllm serve` machine with adapter-only sync (call right after
    the trainer's __init__, built with `use_vllm=False` so that TRL started no NCCL client). The address is TRL's
    (--vllm_server_base_url, else host and port), each request bounded by --vllm_server_timeout; the server is checked
    (it answers, takes GRPO_ACCEL_VLLM_API_KEY, loads adapters at run time) before the first step."""
    args = trainer.args
    if args.max_staleness >= 1:
        refuse_multi_turn(trainer, f"--vllm_mode server sampling ahead (--max_staleness {args.max_staleness})",
                          ": the batch ahead is sampled in one request", "--max_staleness 0")
    for flag, value in (("--generation_kwargs", args.generation_kwargs),
                        ("--vllm_structured_outputs_regex", args.vllm_structured_outputs_regex)):
        if value:  # TRL's server client sends them; ours would drop them without a word
            raise ConfigError(f"{flag} is not sent to the server by the adapter-sync client (--vllm_mode server with "
                              f"LoRA). Fix: leave {flag} unset, or train full fine-tuning through TRL's server mode.")
    k, m = args.weight_sync_steps, args.max_staleness
    if k > 1 and k > m:  # a batch is sampled with an adapter up to k steps old (k - 1 when not sampled ahead)
        raise ConfigError(f"--weight_sync_steps {k} samples batches with an adapter up to {k - (m == 0)} steps old, "
                          f"past --max_staleness {m}: they would be dropped and sampled again. Fix: --max_staleness "
                          f"{k}, or --weight_sync_steps {max(m, 1)}.")
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    # the adapter files in the base's dtype: vLLM casts a loaded adapter to the served model's dtype, so PEFT's fp32
    # adapter over a bf16 base would send twice the bytes the server keeps (adapter_sync's docstring)
    adapter_dtype = base_dtype(trainer.accelerator.unwrap_model(trainer.model))
    generation = ServerGeneration(
        trainer.accelerator, policy=lambda: trainer.accelerator.unwrap_model(trainer.model),
        step=lambda: trainer.state.global_step, training=lambda: trainer.model.training, base_url=base_url,
        sync_dir=args.adapter_sync_dir or os.path.join(args.output_dir, "adapter_sync"),
        max_completion_length=args.max_completion_length,
        sampling=sampling_options(args),
        max_staleness=args.max_staleness, weight_sync_steps=args.weight_sync_steps, timeout_s=args.vllm_server_timeout,
        adapter_dtype=adapter_dtype)
    generation.check()
    attach_to_trl(trainer, generation, "server")
    ahead = "the next batch sampled while this one trains" if args.max_staleness else "synchronous"
    files = f" in {str(adapter_dtype).removeprefix('torch.')}" if adapter_dtype is not None else ""
    log(f"generation route vllm_server: {base_url}, adapter-only sync{files} every {args.weight_sync_steps} step(s) "
        f"through {generation.sync.sync_dir}; {ahead} (max_staleness {args.max_staleness})")
    return generation


__all__ = ["ServerMode", "attach_server"]
