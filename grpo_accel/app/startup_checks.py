"""Start-up checks that need no weights: run before anything loads, by `launch/train.py` and `grpo-accel plan`.

    failures = run_checks(spec, hf_config, prompt_tokens=512, gpu_bytes=80 * GIB)   # [] when the run can start

Each check reads the resolved run spec (`run_spec.RunSpec`) and the model's HF config (the checkpoint's
config.json or `architectures.py`'s copy: no weights) and returns None or one message naming the fix. A user
learns in a second that 110K tokens exceed a model's context, not after loading 16 GB.
"""

from __future__ import annotations

from grpo_accel.core.errors import ConfigError
from grpo_accel.core.units import GIB
from grpo_accel.planning.routes import ROUTES

# A padded [B, 1, T, T] boolean mask for SDPA above this size is refused (12 GiB per row at T = 110K).
MAX_MASK_BYTES = 1 * GIB
# Attention kernels that take padded rows without a [B, 1, T, T] mask (they unpad to varlen).
MASK_FREE_ATTENTION = ("flash_attention_2", "flash_attention_3")
# rope types whose context is factor x original_max_position_embeddings
SCALED_ROPE = ("yarn", "linear", "dynamic", "longrope")


class StartupCheckError(ConfigError):
    """A run that cannot start as configured; the message names the check and the fix."""


def model_config(spec, prefer_named: bool = False):
    """The model's HF config with the run's model_init_kwargs applied, without weights: the checkpoint's
    config.json (hub: that file only), or architectures.py's copy for a preset's named model offline
    (`prefer_named`: that copy first, as `grpo-accel plan` does: no network needed)."""
    from grpo_accel.data.models import DEFAULT_MODEL, TINY_CONFIGS, embedded_model_dir, looks_like_hub_id
    from grpo_accel.planning.architectures import ALIASES, ARCHITECTURES, get_architecture

    name = spec.script.model
    kwargs = {k: v for k, v in (spec.config.model_init_kwargs or {}).items()
              if k in ("rope_parameters", "max_position_embeddings", "attn_implementation")}
    if prefer_named and (name.lower() in ALIASES or name.lower() in ARCHITECTURES):
        config = get_architecture(name)
    elif name in TINY_CONFIGS:
        from transformers import AutoConfig

        tiny = dict(TINY_CONFIGS[name])
        config = AutoConfig.for_model(tiny.pop("model_type"), max_position_embeddings=2048, **tiny)
    elif name in (DEFAULT_MODEL, "default"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(embedded_model_dir())
    else:
        import os

        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(name)
        except Exception as exc:  # offline hub id: the shape known offline for a preset's model, else the error
            if name.lower() in ALIASES:
                config = get_architecture(name)
            elif os.path.exists(name) or not looks_like_hub_id(name):
                from grpo_accel.data.models import resolve_model_path

                resolve_model_path(name)  # raises its named-fix error for a bad path
                raise
            else:
                from grpo_accel.data.models import ModelNotFoundError

                raise ModelNotFoundError(f"model {name!r} could not be loaded from the hub ({type(exc).__name__}). "
                                         f"Fix: check the name and your network/HF token, pass a local directory, or "
                                         f"use the embedded default --model {DEFAULT_MODEL}.") from exc
    for key, value in kwargs.items():
        if key == "rope_parameters":
            base = dict(getattr(config, "rope_parameters", None) or {})
            if "rope_theta" in base and "rope_theta" not in value:
                raise StartupCheckError(
                    f"model_init_kwargs.rope_parameters has no rope_theta; transformers would replace the "
                    f"checkpoint's {base['rope_theta']:g} with its default. Fix: add \"rope_theta\": "
                    f"{base['rope_theta']:g} to it.")
        setattr(config, key, value)
    return config


def context_tokens(config) -> int | None:
    """The longest sequence the model takes: max_position_embeddings, or factor x the original context under
    YaRN / linear / dynamic rope scaling."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in SCALED_ROPE and rope.get("factor"):
        original = rope.get("original_max_position_embeddings") or limit
        limit = max(limit or 0, int(rope["factor"] * original))
    return limit


def check_context(spec, config, prompt_tokens: int) -> str | None:
    limit = context_tokens(config)
    need = prompt_tokens + spec.config.max_completion_length
    if not limit or need <= limit:
        return None
    scaled = (getattr(config, "rope_parameters", None) or {}).get("rope_type") in SCALED_ROPE
    rope = "" if scaled or not str(getattr(config, "model_type", "")).startswith("qwen3") else (
        " (Qwen3 takes YaRN past 32K: model_init_kwargs rope_parameters with factor 4 give 131,072)")
    return (f"context: {prompt_tokens} prompt + {spec.config.max_completion_length} completion tokens exceed "
            f"{spec.script.model}'s context of {limit} tokens{rope}. Fix: lower --max_completion_length to "
            f"{max(limit - prompt_tokens, 0)}, or a model with a longer context.")


def check_attention_mask(spec, config, prompt_tokens: int) -> str | None:
    """Padded rows at long T make transformers build a [B, 1, T, T] mask for SDPA/eager attention."""
    from grpo_accel.parallel.packing import packing_unsupported_reason

    impl = (spec.config.model_init_kwargs or {}).get("attn_implementation") or "sdpa"
    if impl in MASK_FREE_ATTENTION:
        return None
    why_padded = "--padding_free is off"
    if spec.config.padding_free:
        config._attn_implementation = impl if impl != "sdpa" else None  # the kernel the run will load
        why_padded = packing_unsupported_reason(config)
        if why_padded is None:
            return None  # packed rows: no mask at all
    T = prompt_tokens + spec.config.max_completion_length
    mask_bytes = spec.config.per_device_train_batch_size * T * T
    if mask_bytes <= MAX_MASK_BYTES:
        return None
    return (f"attention mask: padded rows of {T} tokens ({why_padded}) make {impl} attention build a [B, 1, T, T] "
            f"mask of {mask_bytes / GIB:.1f} GiB per micro-batch. Fix: --padding_free true (packed rows, no mask) "
            f"where the model allows it, or --model_init_kwargs '{{\"attn_implementation\": \"flash_attention_2\"}}'.")


def check_engine(spec) -> str | None:
    """Colocated vLLM against the distributed setup."""
    c, p = spec.config, spec.preset
    if not c.use_vllm or c.vllm_mode != "colocate":
        return None
    from grpo_accel.generation.vllm_colocate import unsupported_options

    refusal = unsupported_options(c)
    if refusal:
        return f"colocated vLLM: {refusal}"
    if p.deepspeed_stage >= 3:
        return (f"colocated vLLM under DeepSpeed ZeRO-3 ({p.name}): each rank would gather the whole model to push "
                f"it. Fix: --use_vllm false, --vllm_mode server, or a ZeRO-2 preset.")
    return None


def check_sequence_parallel(spec, config) -> str | None:
    """Ulysses SP against the model's heads and attention kernel (grpo_accel.parallel.sequence_parallel)."""
    sp = spec.config.sequence_parallel_size
    if sp <= 1:
        return None
    from grpo_accel.parallel.sequence_parallel import unsupported_reason

    reason = unsupported_reason(config, sp, (spec.config.model_init_kwargs or {}).get("attn_implementation"))
    return None if reason is None else (f"sequence parallelism: {reason}. Fix: a --sequence_parallel_size that "
                                        f"divides the attention heads, or 1.")


def check_memory(spec, gpu_bytes: int | None, host_bytes: int | None = None,
                 generation: str | None = None) -> str | None:
    """The planner's verdict on this GPU; with `host_bytes`, offloaded layer inputs the host cannot hold are
    planned on the device (`fit_host`), and a host too small even then is named. `generation`: plan that route
    instead of the run's (a refused vLLM share runs vllm_copy: two copies of the weights)."""
    from grpo_accel.core.units import GIB
    from grpo_accel.planning.fitting import fit_host

    if gpu_bytes is None:
        return None
    planned = spec.plan(**({"generation": generation} if generation else {}))
    plan = fit_host(planned, host_bytes)
    verdict = plan.verdict(gpu_bytes)
    if verdict.fits:
        return None
    if plan is not planned and planned.verdict(gpu_bytes).fits:
        wanted = sum(planned.host.values())
        return (f"host memory: this run offloads {wanted / GIB:.1f} GiB of layer inputs, this machine has "
                f"{host_bytes / GIB:.1f} GiB; the rest on the GPU makes the peak {plan.peak_gib:.1f} GiB of "
                f"{gpu_bytes / GIB:.1f}. Fix: a shorter --max_completion_length (`grpo-accel plan --find-max-t` names "
                f"the longest that fits), or a host with more memory.")
    route, why = (generation, ROUTES[generation]) if generation else spec.route()
    return f"memory: generation route {route} ({why}); this run {verdict}"


def plan_checks(spec, config, prompt_tokens: int, gpu_bytes: int | None, host_bytes: int | None = None) -> list[str]:
    """The checks of the plan itself (context, mask, engine vs setup, SP vs heads, memory): a failure here fails
    on any machine."""
    found = [check_context(spec, config, prompt_tokens), check_attention_mask(spec, config, prompt_tokens),
             check_engine(spec), check_sequence_parallel(spec, config), check_memory(spec, gpu_bytes, host_bytes)]
    return [f for f in found if f]


def machine_checks(spec) -> list[str]:
    """What this machine lacks that the run's machine needs (client packages). The training machine fails on them
    (`run_checks`); a planning machine only warns (`grpo-accel plan`): planning a run for another machine must
    not need that machine's installs. find_spec, not import: DeepSpeed alone takes seconds to import."""
    import importlib.util

    c, p = spec.config, spec.preset
    attn = (c.model_init_kwargs or {}).get("attn_implementation")
    needs = [  # (used by this run, module, name a user knows, what for, fix)
        (spec.script.quantization == "4bit", "bitsandbytes", "bitsandbytes", "4-bit (QLoRA) weights",
         "pip install -e '.[qlora]'"),
        (p.deepspeed_stage > 0 or c.sequence_parallel_size > 1, "deepspeed", "DeepSpeed",
         f"{p.name}'s ZeRO / sequence parallelism", "pip install -e '.[deepspeed]'"),
        (attn == "flash_attention_2", "flash_attn", "flash-attn", "attn_implementation flash_attention_2",
         "pip install flash-attn"),
        (attn == "flash_attention_3", "flash_attn_interface", "flash-attn 3", "attn_implementation flash_attention_3",
         "install flash-attn 3 (hopper build)"),
    ]
    found = [f"this machine lacks {name} ({why}); the run's machine needs it. Fix there: {fix}"
             for used, module, name, why, fix in needs if used and importlib.util.find_spec(module) is None]
    if c.use_vllm and c.vllm_mode == "colocate":
        from grpo_accel.generation.vllm_availability import read_vllm_install, vllm_stack_problem

        # An installed vLLM this run cannot use (another line, another torch, no bitsandbytes for QLoRA's 4-bit
        # engine) fails here, from package metadata; no vLLM at all falls back to generate() with its own line.
        problem = vllm_stack_problem(read_vllm_install(), four_bit=spec.script.quantization == "4bit")
        if problem is not None:
            found.append(f"colocated vLLM: {problem}")
    # LoRA: our adapter sync speaks HTTP (server_generation.py), no vLLM here; full fine-tuning: TRL's client
    if c.use_vllm and c.vllm_mode == "server" and spec.script.lora_r == 0:
        from grpo_accel.generation.vllm_availability import vllm_unavailable_reason

        why = vllm_unavailable_reason()  # TRL's server client is part of vLLM: the training machine needs it too
        if why is not None:
            found.append(f"this machine lacks vLLM ({why}): TRL's client for --vllm_mode server with full "
                         f"fine-tuning is part of it; the run's machine needs it. Fix there: pip install -e "
                         f"'.[vllm]', or --lora_r 16 (adapter-only sync over HTTP, no vLLM on this machine), or "
                         f"--use_vllm false (generate() on these GPUs: whole-sequence KV).")
    return found


def run_checks(spec, config, prompt_tokens: int, gpu_bytes: int | None, host_bytes: int | None = None) -> list[str]:
    """Every check's failure message on the training machine, the plan's and this machine's (empty: it can start)."""
    return plan_checks(spec, config, prompt_tokens, gpu_bytes, host_bytes) + machine_checks(spec)


def host_memory_bytes() -> int | None:
    """This machine's total memory (Linux /proc/meminfo), None where it cannot be read."""
    from grpo_accel.offload.residency import meminfo_bytes

    return meminfo_bytes("MemTotal")


def raise_on_failure(failures: list[str]) -> None:
    if failures:
        raise StartupCheckError(failures[0] + (f" ({len(failures) - 1} more check(s) fail: `grpo-accel plan` with "
                                               f"the same flags lists them)" if len(failures) > 1 else ""))
