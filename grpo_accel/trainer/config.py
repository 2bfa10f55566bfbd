"""GRPOAccelConfig: TRL's GRPOConfig plus only the fields grpo_accel adds, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from grpo_accel.core.errors import ConfigError
from grpo_accel.core.processes import launched_processes
from grpo_accel.core.settings import LOGPROB_IMPLS, OFFLOAD_RECOMPUTE_TOKENS, share_prompt_blocker
from grpo_accel.parallel.shared_prompt import SHARE_PROMPT_MODES


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


@dataclass
class GRPOAccelConfig(GRPOConfig):
    """TRL's GRPOConfig (every field, TRL's defaults) plus the savers' fields below, validated on creation: a value
    that cannot run stops here with one `error:` line naming the field and the fix. `from_trl(config)` takes a TRL
    GRPOConfig as it is set. What each TRL field does with the savers on: docs/trl-compatibility.md."""

    logprob_impl: str = field(
        default="auto",
        metadata={"help": "Log-prob head: 'trl' (TRL's own chunked head), 'chunked' (ours, torch), 'triton' "
                          "(ours, Triton kernels; CUDA), 'auto' (triton on CUDA when importable, else chunked)."},
    )
    logprob_mini_batch: int | None = field(
        default=None,
        metadata={"help": "Rows (sequences) per model forward when computing log-probs; None = all at once. "
                          "Smaller bounds the hidden-state memory of the policy forward."},
    )
    padding_free: bool = field(
        default=True,
        metadata={"help": "Log-prob passes (policy, old, reference) run on packed rows of real tokens only, with "
                          "per-sequence position ids, unpacked to TRL's layout (same numbers, no padding compute). "
                          "Works with either head (logprob_impl). Falls back to padded rows with one log line "
                          "where the model cannot (eager attention, sliding windows, length-dependent or no RoPE)."},
    )
    share_prompt: str = field(
        default="auto",
        metadata={"help": "Log-prob passes compute each prompt once per group: the group's rows become one packed "
                          "stretch [prompt][c1]...[cG], each completion attending to the whole prompt and to itself "
                          "only (exact; grpo_accel/parallel/shared_prompt.py). 'auto': for groups where that "
                          "removes a quarter or more of its tokens (long prompts); 'true': every group of >= 2 "
                          "rows; 'false': never. Needs padding_free with sdpa attention; not under sequence "
                          "parallelism."},
    )
    logprob_token_budget: int | None = field(
        default=None,
        metadata={"help": "padding_free: most real tokens per log-prob forward, rows grouped longest first; "
                          "None = what one padded forward held (logprob_mini_batch or TRL's rows x sequence "
                          "length), capped at the offload's re-run group when offload is on."},
    )
    logprob_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per chunk in the fused log-prob head; None = chosen from free memory."},
    )
    logprob_vocab_tile: int | None = field(
        default=None,
        metadata={"help": "Vocabulary tile of the fused log-prob head; None = chosen from free memory."},
    )
    offload_activations: str = field(
        default="auto",
        metadata={"help": "Offload checkpointed layer inputs to pinned host memory: 'true', 'false' or 'auto' "
                          "(on with a CUDA device and gradient checkpointing)."},
    )
    offload_recompute_tokens: int = field(
        default=OFFLOAD_RECOMPUTE_TOKENS,
        metadata={"help": "Offload's backward re-run (and checkpointed forward) in pieces of at most this many tokens: "
                          "row groups, and sequence tiles within a longer row. Smaller: less memory, more launches."},
    )
    offload_device_budget_gib: float = field(
        default=0.0,
        metadata={"help": "Layer inputs kept on the GPU instead of host memory, GiB (set from the planner when the "
                          "host cannot hold them all; 0 = offload every one)."},
    )
    vllm_share_weights: bool = field(
        default=True,
        metadata={"help": "Colocated vLLM with LoRA: the engine and the trainer use one copy of the frozen base "
                          "weights (checked at start-up; falls back to two copies with a warning)."},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ulysses sequence parallelism: each group of this many processes is one data-parallel "
                          "rank; they share its rows, split each along its length (attention through DeepSpeed's "
                          "all-to-all, grpo_accel/parallel/sequence_parallel.py), so per-GPU activations fall by "
                          "this factor. per_device_train_batch_size then counts rows per group. 1 = off. Needs several "
                          "processes, SDPA attention and logprob_impl other than 'trl'."},
    )
    reward_checks: str = field(
        default="trl",
        metadata={"help": "'trl': reward functions behave as in TRL (None or NaN = does not apply to that completion; "
                          "a completion no reward applies to only warns). 'strict' (launch/train.py's default): "
                          "also stop with RewardFunctionError on inf / NaN rewards and on a completion that no reward "
                          "scored (a reward may return None for rows it does not apply to, beside one that scores "
                          "them). Either way a reward that raises or returns the wrong "
                          "number of rewards is named in the error."},
    )
    max_nonfinite_steps: int = field(
        default=0,
        metadata={"help": "Steps with non-finite gradients are skipped; this many in a row stop the run, keeping "
                          "the last good checkpoint. 0 = TRL's behaviour, no guard (launch/train.py's default: 3)."},
    )

    @classmethod
    def from_trl(cls, args: GRPOConfig) -> GRPOAccelConfig:
        """This config with every field of a TRL GRPOConfig as it is set there; ours at their defaults."""
        import dataclasses

        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        values["generation_batch_size"] = None  # derived from steps_per_generation by TRL's __post_init__ (again)
        return cls(**values)

    def __post_init__(self):
        self._check_numbers()  # before TRL's own checks, which name its internals rather than the flag
        self._refuse_accelerates_sp()
        if self.logprob_impl not in LOGPROB_IMPLS:
            raise ConfigError(f"--logprob_impl {self.logprob_impl} is not one of {', '.join(LOGPROB_IMPLS)}.")
        for name in ("logprob_mini_batch", "logprob_chunk_size", "logprob_vocab_tile", "logprob_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} {value} must be a positive integer (or unset: automatic).")
        if self.reward_checks not in ("trl", "strict"):
            raise ConfigError(f"--reward_checks {self.reward_checks}: use trl or strict.")
        normalized = str(self.offload_activations).lower()
        if normalized not in ("true", "false", "auto"):
            raise ConfigError(f"--offload_activations {self.offload_activations}: use true, false or auto.")
        self.offload_activations = normalized
        share = str(self.share_prompt).lower()
        if share not in SHARE_PROMPT_MODES:
            raise ConfigError(f"--share_prompt {self.share_prompt}: use {', '.join(SHARE_PROMPT_MODES)}.")
        self.share_prompt = share
        blocker = share_prompt_blocker(self.padding_free, self.sequence_parallel_size)
        if share == "true" and blocker:
            fix = "--padding_free true, or --share_prompt auto" if self.sequence_parallel_size == 1 else \
                "--share_prompt auto (off under SP) or false"
            raise ConfigError(f"--share_prompt true with --padding_free {str(self.padding_free).lower()} "
                              f"--sequence_parallel_size {self.sequence_parallel_size}: {blocker}. Fix: {fix}.")
        if self.bf16 is None and not self.fp16:
            # TRL defaults to bf16 mixed precision, which HF refuses without a bf16 GPU unless use_cpu is set:
            # default to it only where it can run, so the same config works on a laptop and an H100.
            import torch

            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        super().__post_init__()
        self._share_batches_over_sp_groups()
        self._refuse_what_sp_does_not_run()

    def _share_batches_over_sp_groups(self) -> None:
        """Under sequence parallelism each group of sequence_parallel_size processes is one data-parallel rank
        (grpo_accel/parallel/sequence_parallel.py): TRL's generation batch counts world/sp ranks, and each group's
        batch must split over its processes for generation and hold whole groups of num_generations (TRL normalises
        rewards over rows gathered from every process, where each group's rows appear sp times)."""
        sp, world = self.sequence_parallel_size, launched_processes()
        if sp <= 1 or world == 1:  # one process: SP is off (sequence_parallel.enable says so)
            return
        if world % sp:
            raise ConfigError(f"--sequence_parallel_size {sp} must divide the {world} processes. Fix: launch a "
                              f"multiple of {sp} processes, or --sequence_parallel_size {world}.")
        rows = self.per_device_train_batch_size * self.steps_per_generation  # one group's generation batch
        if rows % self.num_generations or rows % sp:
            multiple = _lcm(self.num_generations, sp)
            steps = multiple // math.gcd(multiple, self.per_device_train_batch_size)
            raise ConfigError(
                f"--sequence_parallel_size {sp}: one SP group generates {rows} completions per generation batch "
                f"(--per_device_train_batch_size {self.per_device_train_batch_size} x steps per generation "
                f"{self.steps_per_generation}), which must be a multiple of --num_generations {self.num_generations} "
                f"and of {sp}. Fix: --gradient_accumulation_steps {steps} (or --steps_per_generation), or a "
                f"--num_generations dividing {rows}.")
        if str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            raise ConfigError("--sequence_parallel_size > 1 runs TRL's training loop only; its evaluation loop is not "
                              "wired for SP. Fix: --eval_strategy no (the held-out accuracy of --eval_size still "
                              "runs).")
        self.generation_batch_size = rows * (world // sp)

    def _refuse_what_sp_does_not_run(self) -> None:
        """Options that sequence parallelism would otherwise drop or route untested, refused with one line each.
        Each log-prob pass under SP is one forward of the group's rows, split along their length: a rows or token
        cap per forward has nothing to cap. Colocated vLLM under SP has never been run (each rank would generate its
        share through its own engine; docs/pairs.md); the SP preset generates on a `trl vllm-serve` node."""

        sp = self.sequence_parallel_size
        if sp <= 1 or launched_processes() == 1:  # one process: SP is off
            return
        for name in ("logprob_mini_batch", "logprob_token_budget"):
            if getattr(self, name) is not None:
                raise ConfigError(f"--{name} {getattr(self, name)} does not apply under --sequence_parallel_size {sp}: "
                                  f"each log-prob pass runs the group's rows in one forward, split along their length "
                                  f"over {sp} processes. Fix: leave --{name} unset (or --sequence_parallel_size 1).")
        if self.use_vllm and self.vllm_mode == "colocate":
            raise ConfigError(f"--sequence_parallel_size {sp} with colocated vLLM is not supported (untested). Fix: "
                              f"--vllm_mode server with a `trl vllm-serve` node (as preset 8xh100_sp8_512k), or "
                              f"--use_vllm false.")

    def _refuse_accelerates_sp(self) -> None:
        """accelerate's ParallelismConfig sp_size / cp_size: TRL refuses it (its batches are built after generation),
        and it would scale our SP's gradients twice (its engine sums an SP group's gradients; ours already scale each
        rank's slice for an engine that averages over every process). Said before TRL's traceback, naming our flag."""
        pc = getattr(self, "parallelism_config", None)
        for name in ("sp_size", "cp_size"):
            n = getattr(pc, name, None) or 1
            if n > 1:
                raise ConfigError(f"--parallelism_config {name}={n}: accelerate's sequence sharding cuts the "
                                  f"dataloader's batches, which GRPO builds only after generation (TRL refuses it). "
                                  f"Fix: drop {name} from parallelism_config and pass --sequence_parallel_size {n}.")

    def _check_numbers(self) -> None:
        """Each numeric flag that cannot work, named as the user typed it, with the fix."""
        for name, low in (("max_completion_length", 1), ("per_device_train_batch_size", 1),
                          ("gradient_accumulation_steps", 1), ("num_generations", 2), ("logging_steps", 1),
                          ("save_steps", 1), ("max_nonfinite_steps", 0), ("sequence_parallel_size", 1),
                          ("offload_recompute_tokens", 1), ("offload_device_budget_gib", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                why = " (GRPO compares each completion with the others of its prompt)" if name == "num_generations" \
                    else ""
                raise ConfigError(f"--{name} {value} must be ≥ {low}{why}. Fix: --{name} "
                                  f"{max(low, 2 if name == 'num_generations' else 1)} or more.")
        if self.temperature is not None and self.temperature <= 0:
            raise ConfigError(f"--temperature {self.temperature} must be > 0 (GRPO samples). Fix: --temperature 0.7 "
                              f"to 1.0.")
        if self.learning_rate < 0:
            raise ConfigError(f"--learning_rate {self.learning_rate} must be ≥ 0. Fix: e.g. --learning_rate 1e-5.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"--max_steps {self.max_steps}: give the number of steps (or -1 for num_train_epochs).")
        world = launched_processes()
        if self.generation_batch_size is None and self.steps_per_generation is None:
            batch = self.per_device_train_batch_size * world * self.gradient_accumulation_steps
            if batch % self.num_generations:
                ok = [g for g in range(2, batch + 1) if batch % g == 0]
                raise ConfigError(
                    f"--num_generations {self.num_generations} must divide the {batch} completions of one generation "
                    f"batch (--per_device_train_batch_size {self.per_device_train_batch_size} x {world} process(es) x "
                    f"--gradient_accumulation_steps {self.gradient_accumulation_steps}). Fix: --num_generations "
                    f"{' or '.join(map(str, ok[-3:])) or 2}, or a batch that is a multiple of {self.num_generations}.")
