"""GRPOAccelConfig: TRL's GRPOConfig plus only the fields grpo_accel adds, validated on creation."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from trl import GRPOConfig

from grpo_accel.core.errors import ConfigError
from grpo_accel.core.processes import launched_processes
from grpo_accel.core.settings import SETTINGS, share_prompt_blocker


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


@dataclass
class GRPOAccelConfig(GRPOConfig):
    """TRL's GRPOConfig (every field, TRL's defaults) plus the savers' fields below, validated on creation: a value
    that cannot run stops here with one `error:` line naming the field and the fix. `from_trl(config)` takes a TRL
    GRPOConfig as it is set. What each TRL field does with the savers on: docs/trl-compatibility.md."""

    # grpo_accel's settings: name, type, default, --help and check come from core.settings.SETTINGS (one entry
    # each); these lines only declare them, and tests/test_settings.py checks that they declare the same types
    logprob_impl: str = SETTINGS["logprob_impl"].field()
    logprob_mini_batch: int | None = SETTINGS["logprob_mini_batch"].field()
    padding_free: bool = SETTINGS["padding_free"].field()
    share_prompt: str = SETTINGS["share_prompt"].field()
    logprob_token_budget: int | None = SETTINGS["logprob_token_budget"].field()
    logprob_chunk_size: int | None = SETTINGS["logprob_chunk_size"].field()
    logprob_vocab_tile: int | None = SETTINGS["logprob_vocab_tile"].field()
    offload_activations: str = SETTINGS["offload_activations"].field()
    offload_recompute_tokens: int = SETTINGS["offload_recompute_tokens"].field()
    offload_device_budget_gib: float = SETTINGS["offload_device_budget_gib"].field()
    vllm_share_weights: bool = SETTINGS["vllm_share_weights"].field()
    sequence_parallel_size: int = SETTINGS["sequence_parallel_size"].field()
    reward_checks: str = SETTINGS["reward_checks"].field()
    max_nonfinite_steps: int = SETTINGS["max_nonfinite_steps"].field()
    max_staleness: int = SETTINGS["max_staleness"].field()
    rollout_budget: int = SETTINGS["rollout_budget"].field()
    routing_replay: str = SETTINGS["routing_replay"].field()
    weight_sync_steps: int = SETTINGS["weight_sync_steps"].field()
    adapter_sync_dir: str | None = SETTINGS["adapter_sync_dir"].field()
    dynamic_sampling: bool = SETTINGS["dynamic_sampling"].field()
    max_sampling_rounds: int = SETTINGS["max_sampling_rounds"].field()

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
        self._check_continuous_batching_config()
        for name, spec in SETTINGS.items():  # each of our fields as the config keeps it, or its one error line
            setattr(self, name, spec.parse(getattr(self, name)))
        share = self.share_prompt
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
        with warnings.catch_warnings():
            if getattr(self, "activation_checkpointing", None) is None:  # the field since transformers 5.2x
                # transformers 5.2x deprecates `gradient_checkpointing` for `activation_checkpointing`, and TRL 1.16
                # defaults and documents the old name (True), so every GRPOConfig warns before our first line with
                # nothing for the user to change (our presets and planner keep TRL's name). This one message only,
                # for this call only: `gradient_checkpointing_kwargs` and every other warning still reach the user.
                warnings.filterwarnings("ignore", message=r"`gradient_checkpointing` is deprecated",
                                        category=FutureWarning)
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

    def _check_continuous_batching_config(self) -> None:
        """--transformers_continuous_batching_config: a JSON object (the command line; transformers parses a string
        starting with `{`) or a mapping (--config YAML, Python) of ContinuousBatchingConfig's keyword arguments. TRL
        reads it only when its trainer is built, after the weights load, and then fails with a traceback: `dict()` of
        a non-JSON string, or ContinuousBatchingConfig's TypeError on a misspelt key."""
        import json

        value, flag = self.transformers_continuous_batching_config, "--transformers_continuous_batching_config"
        example = f"""{flag} '{{"num_blocks": 16, "page_size": 32}}'"""
        if value is None:
            return
        if isinstance(value, str):
            try:
                parsed = json.loads(value) if value.startswith("{") else None  # as transformers parses it
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{flag} {value!r} is not valid JSON ({exc.msg} at character {exc.pos}). Fix: a "
                                  f"JSON object, e.g. {example}.") from exc
            if not isinstance(parsed, dict):
                raise ConfigError(f"{flag} {value!r} is not a JSON object of ContinuousBatchingConfig's arguments. "
                                  f"Fix: {example}.")
            value = parsed
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a mapping of ContinuousBatchingConfig's arguments, got "
                              f"{type(value).__name__}. Fix: {example}.")
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:  # no continuous batching in this transformers: the route's own check names the fix
            return
        import difflib
        import inspect

        known = [k for k in inspect.signature(ContinuousBatchingConfig.__init__).parameters if k != "self"]
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                raise ConfigError(f"{flag}: {key!r} is not an argument of transformers' ContinuousBatchingConfig"
                                  f"{f'; did you mean {close[0]!r}?' if close else '.'} Fix: use its names "
                                  f"({', '.join(known[:4])}, ...).")

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
                          ("save_steps", 1)):
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
