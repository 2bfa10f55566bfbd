"""Run settings: each of grpo_accel's settings defined once (name, type, default, "auto" rule, the unit it is kept
in), and `RunSettings`, the values the code runs with, resolved once from a run's fields on its machine.

    SETTINGS["offload_recompute_tokens"].default                 # 16384 (tokens)
    RunSettings.resolve(config, cuda=True).offload_activations   # "auto" -> True with gradient checkpointing

The vocabulary is the flag's: `--offload_activations` is GRPOAccelConfig.offload_activations (whose fields are made
from SETTINGS), the preset's field and the planner's argument of that name. What a user types is kept as typed on
the config (GiB, "auto"); RunSettings holds what the planner, the offload and the trainer read (bytes, True/False);
the conversions between the two live here only. core/, so that every layer can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from grpo_accel.core.errors import ConfigError
from grpo_accel.core.units import GIB

# Activation offload's re-run piece, in tokens: the backward re-runs a layer on row groups of at most this many
# tokens, and a longer row in sequence tiles of this many (OffloadConfig.recompute_tokens, the planner's
# recompute_tokens, --offload_recompute_tokens).
OFFLOAD_RECOMPUTE_TOKENS = 16384


def offload_activations_on(setting, cuda: bool, gradient_checkpointing: bool) -> bool:
    """--offload_activations: `true`/`false` as given (bools or strings); `auto`: on with CUDA and gradient
    checkpointing (offload only moves what checkpointing saves; on CPU the host is the device)."""
    if isinstance(setting, bool):
        return setting
    key = setting.strip().lower() if isinstance(setting, str) else None
    if key not in ("auto", "true", "false"):
        raise ValueError(f"activation offload must be True, False or 'auto', got {setting!r}")
    return bool(cuda and gradient_checkpointing) if key == "auto" else key == "true"


# --offload_device_budget_gib: layer inputs kept on the GPU, typed in GiB; the planner and the offload keep bytes.
# These two are the only conversions between them (the runner raises it from the planner's fit_host).
def device_budget_bytes(gib: float | None) -> int:
    return int((gib or 0) * GIB)


def device_budget_gib(nbytes: int) -> float:
    return nbytes / GIB


def generations_per_process(per_device_train_batch_size: int, steps_per_generation: int | None = None,
                            gradient_accumulation_steps: int | None = None, generation_batch_size: int | None = None,
                            processes: int = 1) -> int:
    """Sequences one process generates at once (the generation batch its KV cache or engine holds): TRL's
    per_device_train_batch_size x steps_per_generation (default gradient_accumulation_steps). A global
    generation_batch_size, before TRL resolves it (a preset planned on another machine), is that / processes."""
    if generation_batch_size:
        return -(-generation_batch_size // processes)
    return per_device_train_batch_size * (steps_per_generation or gradient_accumulation_steps or 1)


# --logprob_impl: TRL's head, our chunked one, the Triton kernel, or "auto" (Triton on CUDA, else chunked)
LOGPROB_IMPLS = ("trl", "chunked", "triton", "auto")


SHARE_PROMPT_MIN_SAVED = 0.25  # share_prompt="auto": share a group when it removes >= this share of its tokens


def shared_group_tokens(prompt_len: int, completion_lens: list[int]) -> int:
    """Tokens of one group in the shared-prompt layout (grpo_accel.parallel.shared_prompt): the prompt but its last
    token once, then each completion after a copy of that last token."""
    return prompt_len - 1 + sum(c + 1 for c in completion_lens)


def share_prompt_blocker(padding_free: bool, sequence_parallel_size: int) -> str | None:
    """Why the shared-prompt layout cannot run with these settings (None: it can): the config refuses
    --share_prompt true for it, "auto" turns off, the planner plans without it, the trainer and the runner say so."""
    if sequence_parallel_size > 1:
        return ("Ulysses shards each row along its length and a prompt shared by the group's rows would sit on one "
                "shard")
    if not padding_free:
        return "padding_free is off (the shared layout is a packed row)"
    return None


def share_prompt_pays(prompt_len: int, completion_lens: list[int], mode: str) -> bool:
    """Whether a group of rows with this prompt shares it: never for one row or a one-token prompt (nothing saved);
    "true": otherwise always; "auto": when it removes >= SHARE_PROMPT_MIN_SAVED of the group's tokens (a short
    prompt beside long completions stays on the packed path, where one attention call per row and no key copies
    cost least). The trainer decides per batch with this rule, the planner per run with the longest lengths."""
    if mode == "false" or len(completion_lens) < 2 or prompt_len < 2:
        return False
    unshared = sum(prompt_len + c for c in completion_lens)
    saved = unshared - shared_group_tokens(prompt_len, completion_lens)
    return mode == "true" or saved >= SHARE_PROMPT_MIN_SAVED * unshared


SHARE_PROMPT_MODES = ("auto", "true", "false")
OFFLOAD_MODES = ("auto", "true", "false")


@dataclass(frozen=True)
class Setting:
    """One run setting: a flag, a GRPOAccelConfig field, a preset field and a planner argument of one name."""

    name: str
    type: type
    default: object
    unit: str  # what a number counts ("tokens", "GiB", "rows"); "" for a mode or a switch
    help: str
    choices: tuple = ()  # the strings it takes (normalized to lower case); () = any value of its type
    minimum: int | None = None  # the smallest number that runs (None: unchecked; a None value always means "auto")
    auto: str = ""  # what "auto" (or None) resolves to, and which function decides

    def field(self):
        """The dataclass field GRPOAccelConfig declares for it: default and --help text from here."""
        return dataclasses.field(default=self.default, metadata={"help": self.help})

    def parse(self, value):
        """`value` as the config keeps it, or ConfigError naming the flag: a choice lower-cased (a preset's or a
        YAML's True/False become "true"/"false"), a number checked against its minimum."""
        if self.choices:
            key = str(value).strip().lower()
            if key not in self.choices:
                raise ConfigError(f"--{self.name} {value} is not one of {', '.join(self.choices)}. Fix: --{self.name} "
                                  f"{self.default}, or see its --help.")
            return key
        if self.minimum is not None and value is not None and value < self.minimum:
            unset = " (or unset: automatic)" if self.default is None else ""
            raise ConfigError(f"--{self.name} {value} must be ≥ {self.minimum}{unset}. Fix: --{self.name} "
                              f"{max(self.minimum, 1)} or more{unset}.")
        return value


def _settings(*items: Setting) -> dict[str, Setting]:
    return {s.name: s for s in items}


SETTINGS: dict[str, Setting] = _settings(
    Setting("logprob_impl", str, "auto", "", "Log-prob head: 'trl' (TRL's own chunked head), 'chunked' (ours, "
            "torch), 'triton' (ours, Triton kernels; CUDA), 'auto' (triton on CUDA when importable, else chunked).",
            choices=LOGPROB_IMPLS, auto="triton on CUDA when importable (ops.select.triton_usable), else chunked"),
    Setting("logprob_mini_batch", int | None, None, "rows", "Rows (sequences) per model forward when computing "
            "log-probs; None = all at once. Smaller bounds the hidden-state memory of the policy forward.",
            minimum=1, auto="all of TRL's rows in one forward"),
    Setting("padding_free", bool, True, "", "Log-prob passes (policy, old, reference) run on packed rows of real "
            "tokens only, with per-sequence position ids, unpacked to TRL's layout (same numbers, no padding "
            "compute). Works with either head (logprob_impl). Falls back to padded rows with one log line where the "
            "model cannot (eager attention, sliding windows, length-dependent or no RoPE)."),
    Setting("share_prompt", str, "auto", "", "Log-prob passes compute each prompt once per group: the group's rows "
            "become one packed stretch [prompt][c1]...[cG], each completion attending to the whole prompt and to "
            "itself only (exact; grpo_accel/parallel/shared_prompt.py). 'auto': for groups where that removes a "
            "quarter or more of its tokens (long prompts); 'true': every group of >= 2 rows; 'false': never. Needs "
            "padding_free with sdpa attention; not under sequence parallelism.", choices=SHARE_PROMPT_MODES,
            auto="per batch, share_prompt_pays; off where share_prompt_blocker names a reason"),
    Setting("routing_replay", str, "auto", "", "Mixture-of-experts models: the log-prob passes route each token to the "
            "experts its sampler chose (recorded during generation), gate weights from the current router (R3; "
            "grpo_accel/head/routing_replay.py). 'auto' and 'true': replay where the route records the routing "
            "(a route that cannot says so in one line); 'false': route by the trainer's own top-k, the mismatch "
            "still measured (routing/flip_frac). Dense models: nothing to do.", choices=("auto", "true", "false")),
    Setting("logprob_token_budget", int | None, None, "tokens", "padding_free: most real tokens per log-prob "
            "forward, rows grouped longest first; None = what one padded forward held (logprob_mini_batch or TRL's "
            "rows x sequence length), capped at the offload's re-run group when offload is on.", minimum=1,
            auto="parallel.packing.default_token_budget"),
    Setting("logprob_chunk_size", int | None, None, "tokens", "Tokens per chunk in the fused log-prob head; None = "
            "chosen from free memory.", minimum=1, auto="ops.logprobs.plan_blocks, from free memory"),
    Setting("logprob_vocab_tile", int | None, None, "vocabulary entries", "Vocabulary tile of the fused log-prob "
            "head; None = chosen from free memory.", minimum=1, auto="ops.logprobs.plan_blocks, from free memory"),
    Setting("offload_activations", str, "auto", "", "Offload checkpointed layer inputs to pinned host memory: "
            "'true', 'false' or 'auto' (on with a CUDA device and gradient checkpointing).", choices=OFFLOAD_MODES,
            auto="offload_activations_on: CUDA and gradient checkpointing"),
    Setting("offload_recompute_tokens", int, OFFLOAD_RECOMPUTE_TOKENS, "tokens", "Offload's backward re-run (and "
            "checkpointed forward) in pieces of at most this many tokens: row groups, and sequence tiles within a "
            "longer row. Smaller: less memory, more launches.", minimum=1),
    Setting("offload_device_budget_gib", float, 0.0, "GiB", "Layer inputs kept on the GPU instead of host memory, "
            "GiB (set from the planner when the host cannot hold them all; 0 = offload every one).", minimum=0),
    Setting("vllm_share_weights", bool, True, "", "Colocated vLLM with LoRA: the engine and the trainer use one copy "
            "of the frozen base weights (checked at start-up; falls back to two copies with a warning)."),
    Setting("sequence_parallel_size", int, 1, "processes", "Ulysses sequence parallelism: each group of this many "
            "processes is one data-parallel rank; they share its rows, split each along its length (attention "
            "through DeepSpeed's all-to-all, grpo_accel/parallel/sequence_parallel.py), so per-GPU activations fall "
            "by this factor. per_device_train_batch_size then counts rows per group. 1 = off. Needs several "
            "processes, SDPA attention and logprob_impl other than 'trl'.", minimum=1),
    Setting("reward_checks", str, "trl", "", "'trl': reward functions behave as in TRL (None or NaN = does not apply "
            "to that completion; a completion no reward applies to only warns). 'strict' (launch/train.py's "
            "default): also stop with RewardFunctionError on inf / NaN rewards and on a completion that no reward "
            "scored (a reward may return None for rows it does not apply to, beside one that scores them). Either "
            "way a reward that raises or returns the wrong number of rewards is named in the error.",
            choices=("trl", "strict")),
    Setting("max_nonfinite_steps", int, 0, "steps", "Steps with non-finite gradients are skipped; this many in a row "
            "stop the run, keeping the last good checkpoint. 0 = TRL's behaviour, no guard (launch/train.py's "
            "default: 3).", minimum=0),
    Setting("max_staleness", int, 1, "steps", "--vllm_mode server with LoRA, or --rollout_budget: optimizer steps a "
            "batch's policy may lag the one training on it. 1: the server samples step n+1's batch while step n "
            "trains (a completion carried by --rollout_budget continues one step later), and TRL's importance-"
            "sampling correction (--vllm_importance_sampling_*) covers the step between; a carried group older is "
            "dropped and counted; 0: synchronous. TRL's AsyncGRPOConfig name (docs/off-policy-rollouts.md).",
            minimum=0),
    Setting("rollout_budget", int, 0, "tokens", "Decode rounds of at most this many tokens per completion: a step "
            "trains on the first groups whose completions have all ended, and the completions still running are "
            "carried into the next step under the new weights (their older tokens corrected with TRL's importance "
            "sampling; max_staleness bounds their age). 0 = off: every step decodes until its longest completion "
            "ends. Routes continuous_batching and colocated vLLM (grpo_accel/trainer/carried_rollouts.py).", minimum=0),
    Setting("weight_sync_steps", int, 1, "steps", "--vllm_mode server with LoRA: optimizer steps between adapter "
            "loads on the server (TRL's AsyncGRPOConfig name); each is the adapter's MBs, never the base.", minimum=1),
    Setting("adapter_sync_dir", str | None, None, "", "--vllm_mode server with LoRA: the folder each step's adapter "
            "is written to for the server to load; it must be readable at the same path on the server's machine (a "
            "shared filesystem across machines). None = <output_dir>/adapter_sync."),
    Setting("dynamic_sampling", bool, False, "", "DAPO's dynamic sampling: a group whose completions all got the same "
            "reward (within 1e-5 of the rewards' scale) does not enter the step's batch; further prompts are sampled "
            "in rounds to fill it with groups whose rewards differ (grpo_accel/trainer/dynamic_sampling.py). Runs on "
            "every generation route; with --rollout_budget or a server sampling ahead, refill rounds take the groups "
            "already sampled first."),
    Setting("max_sampling_rounds", int, 3, "rounds", "--dynamic_sampling: generation rounds per generation batch at "
            "most (the first included; DAPO's max_num_gen_batches); a batch still short trains on what it has, flat "
            "groups filling it, and its metrics say so.", minimum=1),
)


def field_of(source, name: str, default=None):
    """`name` from a run's fields (a mapping of flag names: a preset's, a resolved run's) or a config object."""
    return source.get(name, default) if isinstance(source, Mapping) else getattr(source, name, default)


def setting(source, name: str):
    """Our setting `name` from a run's fields or a config object (`field_of`); its default where the source lacks it
    (a TRL GRPOConfig, a trainer TRL's tests built without our init)."""
    return field_of(source, name, SETTINGS[name].default)


@dataclass(frozen=True)
class RunSettings:
    """What the planner, the offload and the trainer run with, resolved once from a run's fields on its machine:
    the "auto" rules applied where the machine decides them, GiB as bytes. The trainer makes one from its config
    (`GRPOAccelTrainer.settings`), a preset's plan from the run's fields (`Preset.plan_inputs`): the same rules."""

    offload_activations: bool  # "auto" resolved: CUDA and gradient checkpointing
    offload_recompute_tokens: int  # tokens per re-run piece
    offload_device_budget_bytes: int  # layer inputs kept on the device, bytes
    padding_free: bool  # asked for (the trainer may still fall back where the model cannot pack)
    share_prompt: str  # "auto" / "true" / "false": "false" where share_prompt_blocker names a reason
    sequence_parallel_size: int
    logprob_impl: str  # "auto" stays: the head resolves it where it knows whether Triton imports
    logprob_chunk_size: int | None
    logprob_vocab_tile: int | None
    rollout_budget: int  # 0: off; on route continuous_batching the next batch decodes beside this one
    routing_replay: str = "auto"  # "auto" / "true" / "false" (MoE models)
    sampling_rounds: int = 1  # generation rounds per generation batch at most: --max_sampling_rounds with
    # --dynamic_sampling, else 1

    @classmethod
    def resolve(cls, source, *, cuda: bool) -> RunSettings:
        """From `source` (config object or fields mapping, `setting`) on a machine with (`cuda`) or without CUDA."""
        get = lambda name: setting(source, name)  # noqa: E731
        checkpointing = bool(field_of(source, "gradient_checkpointing", False))  # TRL's field: no SETTINGS entry
        sp = int(get("sequence_parallel_size") or 1)
        padding_free = bool(get("padding_free"))
        share = SETTINGS["share_prompt"].parse(get("share_prompt"))
        return cls(
            offload_activations=offload_activations_on(get("offload_activations"), cuda, checkpointing),
            offload_recompute_tokens=int(get("offload_recompute_tokens") or OFFLOAD_RECOMPUTE_TOKENS),
            offload_device_budget_bytes=device_budget_bytes(get("offload_device_budget_gib")),
            padding_free=padding_free, sequence_parallel_size=sp,
            share_prompt="false" if share_prompt_blocker(padding_free, sp) else share,
            logprob_impl=get("logprob_impl"), logprob_chunk_size=get("logprob_chunk_size"),
            logprob_vocab_tile=get("logprob_vocab_tile"), rollout_budget=int(get("rollout_budget") or 0),
            routing_replay=SETTINGS["routing_replay"].parse(get("routing_replay")),
            sampling_rounds=int(get("max_sampling_rounds")) if get("dynamic_sampling") else 1)


__all__ = ["LOGPROB_IMPLS", "OFFLOAD_MODES", "OFFLOAD_RECOMPUTE_TOKENS", "RunSettings", "SETTINGS",
           "SHARE_PROMPT_MIN_SAVED", "SHARE_PROMPT_MODES", "Setting", "device_budget_bytes", "device_budget_gib",
           "field_of", "generations_per_process", "offload_activations_on", "setting", "share_prompt_blocker",
           "share_prompt_pays", "shared_group_tokens"]
