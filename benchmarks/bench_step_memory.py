"""One GRPO training step (policy forward + backward, no generation): TRL 1.16 vs naive logits vs grpo_accel.

    # CPU (fp32; measures overhead and that every variant computes the same loss, not the GPU memory win)
    OMP_NUM_THREADS=1 python benchmarks/bench_step_memory.py --arch smollm2-135m --num-generations 4 \
        --completion-length 256 --reps 2
    # GPU goal 1: Llama-3.1-8B-shaped LoRA bf16, G=8, T=8192 (goal: ours_head_offload peak <= 40% of trl's,
    # ours_head_offload step time <= 1.05 x ours_head)
    python benchmarks/bench_step_memory.py --arch llama-3.1-8b --num-generations 8 --completion-length 8192
    # GPU goal 2: the longest completion that fits, Qwen3-8B QLoRA, G=8 (bisection, one fresh process per probe)
    python benchmarks/bench_step_memory.py --arch qwen3-8b --quant 4bit --num-generations 8 --find-max-t \
        --completion-length 8192 --impls trl ours_head_offload
    # issue 15, fair baseline: TRL at micro-batch 1 + gradient accumulation + transformers' offload vs ours at
    # micro-batch 1 (sequence tiles past 16K tokens per row); T=32K both run; then the longest T, Qwen3-8B QLoRA
    # (the tiled row at 256K needs minutes of attention per probe: --max-t bounds it, --t-step 8192 keeps probes few)
    python benchmarks/bench_step_memory.py --arch qwen3-8b --quant 4bit --num-generations 8 --completion-length 32768 \
        --reps 1 --impls trl_tuned ours_mb1
    python benchmarks/bench_step_memory.py --arch qwen3-8b --quant 4bit --num-generations 8 --find-max-t \
        --completion-length 32768 --t-step 8192 --max-t 524288 --impls trl_tuned ours_mb1
    # the seeds' table: Llama-3.1-8B LoRA bf16, 20K context, G=8, peak reserved with weights
    python benchmarks/bench_step_memory.py --arch llama-3.1-8b --num-generations 8 --prompt-length 512 \
        --completion-length 19968 --reps 1 --impls trl_tuned ours_mb1 ours_head_offload

Model: a named architecture (`grpo_accel.planning.architectures`) with random weights, bf16 on CUDA / fp32 on CPU,
LoRA r=16 (alpha 32) on all linear layers; `--quant 4bit` loads the decoder linears in NF4 (QLoRA; CUDA + bitsandbytes
only: random_models.save_random_model saves a random bf16 checkpoint once under --ckpt-cache/<arch>, the folder
gpu_presets.py's runs use too, and it loads through BitsAndBytesConfig).
Step: G rows of P prompt + up to T completion tokens (random ids; completion lengths spread from T/2 to T and
right-padded with mask 0 as TRL batches them, --equal-lengths for all T), random advantages, a fixed
`old_per_token_logps` (-log V, so the loss depends on the log-probs instead of being -mean(advantage)), then
`trainer.compute_loss(model, inputs)` (TRL's `_compute_loss`, the same loss math for every variant) + `backward()`.
Gradient checkpointing is switched on exactly as `Trainer.train()` does (the trainer's __init__ does not).

Variants (each in a fresh subprocess, so one's allocator state and peak cannot leak into another's):
  trl                TRL 1.16 GRPOTrainer, its defaults: its own fused LM head, checkpointing, no offload
  trl_tuned          what a long-context TRL user runs: micro-batch 1 + gradient accumulation over the G rows (the
                     same gradient under loss_type="dapo"), checkpointing with transformers' own offload
                     (activation_checkpointing_kwargs={"offload": True}: save_on_cpu; absent on transformers 5.17)
  naive              GRPOTrainer whose log-prob hook materializes logits: logits.float().log_softmax(-1).gather()
  ours_offload_only  GRPOAccelTrainer, logprob_impl="trl", offload_activations="true"
  ours_head          GRPOAccelTrainer, logprob_impl="auto", offload_activations="false"
  ours_head_offload  GRPOAccelTrainer, logprob_impl="auto", offload_activations="true"
  ours_mb1           ours_head_offload at micro-batch 1 + gradient accumulation (rows past 16K tokens in tiles)
On CPU, offload would be the no-op twin; the offload variants run with GRPO_ACCEL_OFFLOAD_FORCE_COPIES=1 so the real
stash/copy/restore path runs. Host and device are the same memory there (metric host_is_device=1), so offload
cannot lower the CPU peak: CPU rows measure overhead and correctness; the memory win is a GPU claim.

Metrics per variant: peak_step_mem_mib = peak during a measured step minus the memory after the model and trainer
are built, peak_step_mem_with_weights_mib = the same peak with them; CUDA: peak_reserved_mib (and _with_weights)
from torch.cuda.max_memory_reserved; time_per_token_us = step time / real (unpadded) tokens. Peaks: CUDA
torch.cuda.max_memory_allocated, CPU peak RSS via VmHWM (both through grpo_accel.core.phase_memory.PhaseMemory), max
over the measured steps; step_time_ms = median over --reps steps after one warm-up step; loss, entropy (TRL's
logged mean) and lora_grad_norm of the first measured step (equal across variants = same computation);
offloaded_peak_mib = saved-activation bytes the offload stash held on the host (0 without offload).
CPU workers run with MALLOC_MMAP_THRESHOLD_=131072 (--cpu-mmap-threshold). With glibc's dynamic default the RSS peak
is mostly freed-but-retained heap (ours_head, smollm2-135m G=4 T=128: 925 MiB, vs 134 MiB with the fixed threshold),
which says nothing about the variant; the fixed threshold costs page faults (slower CPU steps, in every variant).
The CPU command above took 9.5 min on a busy 2-core host (~30 s per step, 3 steps per variant).
Writes benchmarks/results/step_memory.csv (long format; rows for the same op/impl/shape/device are replaced) and
benchmarks/results/step_memory.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
from harness import MIB

# name -> (trainer, logprob_impl, offload_activations, micro-batch 1 + gradient accumulation); None = TRL's
# GRPOTrainer / GRPOConfig untouched
VARIANTS = {
    "trl": ("trl", None, None, False),
    "trl_tuned": ("trl_tuned", None, None, True),
    "naive": ("naive", None, None, False),
    "ours_offload_only": ("ours", "trl", "true", False),
    "ours_head": ("ours", "auto", "false", False),
    "ours_head_offload": ("ours", "auto", "true", False),
    "ours_mb1": ("ours", "auto", "true", True),
}


# ------------------------------------------------------------------------------------------------ worker side
def synthetic_tokenizer():
    """A word-level tokenizer built in code: the trainer needs one (pad/eos ids), the step never tokenizes."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<unk>": 0, "<pad>": 1, "<eos>": 2, "x": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def build_model(arch, device, dtype, quant, ckpt_cache, layers: int = 0, config_fields: dict | None = None):
    """Random weights of a named architecture; `layers` > 0 keeps only that many of its layers (a CPU step in
    seconds with the real width, heads and vocabulary); `config_fields`: what a preset's model_init_kwargs set
    (gpt-oss's YaRN factor 128 for 524,288 positions)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_accel.planning.architectures import get_architecture

    config = get_architecture(arch)
    config.use_cache = False
    for key, value in (config_fields or {}).items():
        setattr(config, key, value)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    if quant != "4bit":
        with torch.device(device):  # random init straight on the device: no 32 GB fp32 detour on the host
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    from campaign.random_models import save_random_model

    from grpo_accel.data.models import quantization_config

    bnb = quantization_config("4bit", dtype)  # clear error naming the fix when bitsandbytes is missing
    # once per arch, shared with gpu_presets.py's runs (the same folder): bitsandbytes quantizes while loading
    path = save_random_model(arch, Path(ckpt_cache), str(dtype).removeprefix("torch."))
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_cache=False, quantization_config=bnb,
                                                device_map={"": torch.cuda.current_device()})


def preset_settings(name: str | None) -> tuple[dict, dict]:
    """(config fields, GRPOConfig fields) a preset sets beyond the architecture: its model_init_kwargs (rope
    scaling) and its recipe's router_aux_loss_coef (gpt-oss presets: 0, offload cannot carry the router loss)."""
    if not name:
        return {}, {}
    from grpo_accel.app.presets.table import get_preset

    preset = get_preset(name)
    trainer_fields = {k: preset.recipe[k] for k in ("router_aux_loss_coef",) if k in preset.recipe}
    return dict(preset.model_init_kwargs), trainer_fields


def make_trainer(impl, model, G, T, device, outdir, trainer_fields: dict | None = None):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    class NaiveLogitsTrainer(GRPOTrainer):
        """TRL's hook, the way it was before fused heads: full [G, T, V] logits, fp32 log_softmax, gather."""

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False, **_):
            with self.accelerator.autocast():
                logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               logits_to_keep=logits_to_keep + 1).logits[:, :-1]
            logp_all = (logits / self.temperature).float().log_softmax(-1)
            logps = logp_all.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
            entropies = None
            if compute_entropy:
                with torch.no_grad():
                    entropies = -(logp_all.exp() * logp_all).sum(-1)
            return logps, entropies, None

    kind, logprob_impl, offload, mb1 = VARIANTS[impl]
    cuda = device == "cuda"
    # micro-batch 1: G micro-batches of one row, gradient accumulation over them (under TRL's default
    # loss_type="dapo" the same gradient as one G-row micro-batch: the loss is normalized by the generation batch)
    batch = dict(per_device_train_batch_size=1, gradient_accumulation_steps=G) if mb1 else dict(
        per_device_train_batch_size=G)
    common = dict(output_dir=outdir, **batch, num_generations=G, max_completion_length=T,
                  report_to="none", bf16=cuda, use_cpu=not cuda, seed=0, **(trainer_fields or {}))
    if kind == "trl_tuned":
        common.update(tuned_checkpointing(cuda))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = dict(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                  processing_class=synthetic_tokenizer(), train_dataset=Dataset.from_dict({"prompt": ["x"] * G}),
                  peft_config=lora)
    torch.manual_seed(0)  # same LoRA init in every variant
    if kind == "ours":
        args = GRPOAccelConfig(**common, logprob_impl=logprob_impl, offload_activations=offload)
        return GRPOAccelTrainer(args=args, **kwargs)
    return (NaiveLogitsTrainer if kind == "naive" else GRPOTrainer)(args=GRPOConfig(**common), **kwargs)


def tuned_checkpointing(cuda: bool) -> dict:
    """What a long-context TRL user sets: checkpointing with transformers' own offload of each checkpoint's input
    (`activation_checkpointing_kwargs={"offload": True}`: torch's save_on_cpu, synchronous copies) on 5.2x;
    transformers 5.17 (the GPU machine's) has only `gradient_checkpointing_kwargs` and no offload; on CPU there is
    nothing to offload to (save_on_cpu pins memory, which needs an accelerator)."""
    import dataclasses

    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    if "activation_checkpointing_kwargs" in fields and cuda:
        return dict(activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True})
    return dict(gradient_checkpointing=True)


def enable_checkpointing_like_train(trainer):
    """What transformers' Trainer.train() does before the first step, so compute_loss sees the model as training
    sees it: `activation_checkpointing*` and `activation_checkpointing_enable` from 5.2x (trainer.py), the
    `gradient_checkpointing*` names before (5.17). With offload installed, our sticky hook keeps its checkpoint
    function either way."""
    args, model = trainer.args, trainer.model
    on = getattr(args, "activation_checkpointing", None)
    on = args.gradient_checkpointing if on is None else on
    gc_kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                     or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if on and hasattr(model, "activation_checkpointing_enable"):
        every_n_layers, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs or None,
                                              every_n_layers=every_n_layers, offload=offload)
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or None)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return bool(layers) and all(m.gradient_checkpointing for m in layers)


def completion_lengths(G, T, equal=False):
    """Completion lengths of the G rows: T for all with `equal`, else spread evenly from T/2 to T (the longest is T),
    as sampled completions end at different EOS positions."""
    return [T] * G if equal or G == 1 else [T // 2 + (T - T // 2) * i // (G - 1) for i in range(G)]


def make_inputs(G, P, T, V, device, equal=False):
    """As TRL batches a generation: prompts of P tokens, completions right-padded to the longest (pad id 1, mask 0
    after each row's end), so the attention mask is not all ones."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, V, (G, n), generator=g).to(device)  # noqa: E731
    lengths = torch.tensor(completion_lengths(G, T, equal), device=device)
    completion_mask = (torch.arange(T, device=device)[None] < lengths[:, None]).long()
    completion_ids = ids(T).masked_fill(completion_mask == 0, 1)
    return dict(
        prompt_ids=ids(P), prompt_mask=torch.ones(G, P, dtype=torch.long, device=device),
        completion_ids=completion_ids, completion_mask=completion_mask,
        advantages=torch.randn(G, generator=g).to(device),
        # fixed "old policy" log-probs: with None TRL uses the current ones detached, the ratio is 1 and the loss
        # value is -mean(advantage) whatever the model computes
        old_per_token_logps=torch.full((G, T), -math.log(V), device=device),
        num_items_in_batch=completion_mask.sum(),
    )


def worker(a) -> dict:
    """Build, warm up, measure: the variant's figures."""
    import torch

    from grpo_accel.core.phase_memory import PhaseMemory
    from grpo_accel.offload import SavedActivationTracker
    from grpo_accel.offload.residency import HostMemoryError

    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    mem = PhaseMemory(a.device)
    out = {"impl": a.worker}
    with tempfile.TemporaryDirectory() as tmp, mem.phase("load"):
        config_fields, trainer_fields = preset_settings(a.preset)
        model = build_model(a.arch, a.device, dtype, a.quant, a.ckpt_cache, config_fields=config_fields)
        trainer = make_trainer(a.worker, model, a.num_generations, a.completion_length, a.device, tmp, trainer_fields)
        out["checkpointing"] = enable_checkpointing_like_train(trainer)
    base = mem.records[-1].end_bytes  # model + adapters (+ the trainer's bookkeeping) in memory
    out.update(base_mib=base / MIB, logprob_impl=getattr(trainer, "logprob_impl", "trl"),
               offload=bool(getattr(trainer, "offload_enabled", False)))
    model = trainer.model
    model.train()
    G, mb1 = a.num_generations, VARIANTS[a.worker][3]
    trainer.current_gradient_accumulation_steps = G if mb1 else 1  # set by the training loop, read by the loss
    inputs = make_inputs(G, a.prompt_length, a.completion_length, model.config.get_text_config().vocab_size,
                         a.device, a.equal_lengths)
    tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())  # real tokens, padding excluded
    # micro-batch 1: one row per forward + backward; num_items_in_batch stays the generation batch's (dapo)
    micro = [{k: v[i:i + 1] if k != "num_items_in_batch" else v for k, v in inputs.items()} for i in range(G)] \
        if mb1 else [inputs]
    lora = [p for n, p in model.named_parameters() if p.requires_grad]

    def step(name):
        model.zero_grad(set_to_none=True)
        tracker = SavedActivationTracker()
        with mem.phase(name), tracker:
            t0 = time.perf_counter()
            loss = 0.0
            for part in micro:
                part_loss = trainer.compute_loss(model, part)
                part_loss.backward()
                loss += part_loss.detach()
                del part_loss
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        rec = mem.records[-1]
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in lora if p.grad is not None]))
        return dict(ms=ms, peak=(rec.peak_bytes - base) / MIB, held=(rec.start_bytes - base) / MIB,
                    loss=loss.item(), entropy=statistics.fmean(trainer._metrics["train"]["entropy"][-len(micro):]),
                    grad_norm=grad_norm.item(), host=tracker.peak["host"] / MIB, total=rec.peak_bytes / MIB,
                    reserved=torch.cuda.max_memory_reserved() / MIB if cuda else None)

    try:
        steps = [step("warmup")] + [step(f"step{i}") for i in range(a.reps)]
    except (torch.OutOfMemoryError, HostMemoryError) as exc:  # the GPU's limit, or the trainer's host budget
        return out | dict(oom=True, host_refused=isinstance(exc, HostMemoryError), error=str(exc).splitlines()[0][:200])
    measured = steps[1:] or steps
    first = measured[0]
    out.update(oom=False, time_ms=[s["ms"] for s in measured], peak_mib=max(s["peak"] for s in measured),
               held_mib=max(s["held"] for s in measured), loss=first["loss"], entropy=first["entropy"],
               grad_norm=first["grad_norm"], offloaded_peak_mib=max(s["host"] for s in measured),
               warmup_peak_mib=steps[0]["peak"], load_1min=os.getloadavg()[0], tokens=tokens,
               peak_with_weights_mib=max(s["total"] for s in measured),
               losses_equal_across_steps=len({s["loss"] for s in steps}) == 1)
    if cuda:
        out["peak_reserved_mib"] = max(s["reserved"] for s in measured)
    return out


# ------------------------------------------------------------------------------------------------ parent side
def run_worker(args, impl, T, reps):
    flags = harness.cli_flags(dict(arch=args.arch, quant=args.quant, num_generations=args.num_generations,
                                   prompt_length=args.prompt_length, completion_length=T, reps=reps, device=args.device,
                                   ckpt_cache=args.ckpt_cache, equal_lengths=args.equal_lengths, preset=args.preset))
    env = harness.step_env(args.device, VARIANTS[impl][2] == "true", args.cpu_mmap_threshold)
    t0 = time.perf_counter()
    res = harness.run_worker(__file__, flags, impl, env=env, label=f"T={T}")
    res["wall_s"] = time.perf_counter() - t0
    return res


def _shape(args, T=None):
    adapter = "qlora-r16" if args.quant == "4bit" else "lora-r16"
    dtype = "bf16" if args.device == "cuda" else "fp32"
    t = f"T={T}" if T is not None else f"T<=max,step={args.t_step}"
    padded = "" if args.equal_lengths else ",padded"  # completions T/2..T right-padded (default)
    preset = f",preset={args.preset}" if args.preset else ""  # its rope scaling and router loss coefficient
    return f"{args.arch},{adapter},G={args.num_generations},P={args.prompt_length},{t},{dtype}{padded}{preset}"


def step_rows(res, args, T):
    metrics = harness.failure_metrics(res)
    if not harness.failed(res):
        metrics += [
            ("peak_step_mem_mib", res["peak_mib"], "MiB"),
            ("step_time_ms", statistics.median(res["time_ms"]), "ms"),
            ("time_per_token_us", statistics.median(res["time_ms"]) * 1e3 / res["tokens"], "us"),
            ("peak_step_mem_with_weights_mib", res["peak_with_weights_mib"], "MiB"),
            ("loss", res["loss"], "nats"),
            ("entropy", res["entropy"], "nats"),
            ("lora_grad_norm", res["grad_norm"], "l2"),
            ("held_between_steps_mib", res["held_mib"], "MiB"),
            ("offloaded_peak_mib", res["offloaded_peak_mib"], "MiB"),
            ("model_mem_mib", res["base_mib"], "MiB"),
            ("checkpointing", float(res["checkpointing"]), "bool"),
            ("head_is_triton", float(res["logprob_impl"] == "triton"), "bool"),
            ("host_is_device", float(args.device == "cpu"), "bool"),
            ("malloc_mmap_threshold", float(args.cpu_mmap_threshold if args.device == "cpu" else 0), "bytes"),
            ("reps", float(len(res["time_ms"])), "count"),
            ("host_load_1min", res["load_1min"], "procs"),
        ]
        if "peak_reserved_mib" in res:  # reserved by the caching allocator: above the model, and in all
            metrics.append(("peak_reserved_mib", res["peak_reserved_mib"] - res["base_mib"], "MiB"))
            metrics.append(("peak_reserved_with_weights_mib", res["peak_reserved_mib"], "MiB"))
    return harness.long_rows("grpo_step_fwd_bwd", res["impl"], _shape(args, T), metrics)


def run_steps(args, run: harness.Results):
    """Each variant in turn, its rows saved as it ends; those --resume finds are skipped."""
    for impl in args.impls:
        if run.skip("grpo_step_fwd_bwd", impl, _shape(args, args.completion_length)):
            continue
        res = run_worker(args, impl, args.completion_length, args.reps)
        brief = {k: res.get(k) for k in ("oom", "peak_mib", "time_ms", "loss", "entropy", "grad_norm",
                                          "offloaded_peak_mib", "logprob_impl", "offload", "checkpointing", "wall_s")}
        print(f"{impl}: {json.dumps(brief)}", flush=True)
        run.save(step_rows(res, args, args.completion_length))


def plan_for(arch: str, quant: str, G: int, P: int, impl: str, T: int = 1024):
    """The planner's model of one variant's CUDA step (bf16, LoRA r=16): --find-max-t's first probe, and the
    prediction campaign/run.py's summary holds against each measured GPU row."""
    from grpo_accel.planning.memory import plan_memory

    kind, logprob_impl, offload, mb1 = VARIANTS[impl]
    return plan_memory(arch, model_dtype="bf16", quantization=quant, lora_r=16, num_generations=G, max_prompt_length=P,
                       max_completion_length=T, per_device_train_batch_size=1 if mb1 else G,
                       # transformers' offload keeps what ours keeps, without our pieces (row groups, tiles)
                       offload_activations=offload == "true" or kind == "trl_tuned",
                       offload_recompute_tokens=None if kind != "ours" else 16384,
                       logprob_impl={"naive": "naive", "ours": logprob_impl}.get(kind, "trl"), device="cuda")


def planned_max_t(args, impl) -> int:
    """The planner's longest completion for `impl` on this GPU and host (grpo_accel.planning.memory), 0 on CPU: the
    first probe of --find-max-t, and the figure the planner goal compares with the measured one."""
    if args.device != "cuda":
        return 0
    import torch

    from grpo_accel.offload.residency import host_available_bytes
    from grpo_accel.planning.fitting import find_max_completion_length

    plan = plan_for(args.arch, args.quant, args.num_generations, args.prompt_length, impl)
    t, _ = find_max_completion_length(plan, torch.cuda.get_device_properties(0).total_memory,
                                      host_available_bytes(), step=args.t_step)
    return t


def find_max_t(args, run: harness.Results):
    """Per impl: from the planner's longest T (CUDA; --completion-length on CPU or with --no-plan-probes) grow by
    1.25x (2x without a plan) until a step does not fit, then bisect to --t-step. Each impl's rows saved as it ends;
    those --resume finds are skipped."""
    for impl in args.impls:
        if run.skip("grpo_max_completion_length", impl, _shape(args), "max_completion_length", "bisected"):
            continue
        rows, probes = [], {}
        planned = planned_max_t(args, impl) if args.plan_probes else 0
        growth = 1.25 if planned else 2.0
        if planned:
            rows.append(dict(op="grpo_max_completion_length", impl=impl, shape=_shape(args),
                             metric="planned_max_completion_length", value=str(planned), unit="tokens"))

        def fits(T):
            if T not in probes:
                probes[T] = run_worker(args, impl, T, reps=1)
                killed = "killed_by_signal" in probes[T]
                verdict = "killed" if killed else "oom" if probes[T]["oom"] else "fits"
                print(f"{impl} T={T}: {verdict} ({probes[T]['wall_s']:.0f} s)", flush=True)
            return not (probes[T]["oom"] or "killed_by_signal" in probes[T])

        lo, hi, T = 0, None, planned or args.completion_length
        while hi is None and T <= args.max_t:
            grown = max(T + args.t_step, int(T * growth) // args.t_step * args.t_step)
            lo, hi, T = (T, None, grown) if fits(T) else (lo, T, T)
        hi = hi or args.max_t + args.t_step  # every probe up to --max-t fit
        while hi - lo > args.t_step:
            mid = max(args.t_step, (lo + hi) // 2 // args.t_step * args.t_step)
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        rows.append(dict(op="grpo_max_completion_length", impl=impl, shape=_shape(args), metric="max_completion_length",
                         value=str(lo), unit="tokens"))
        rows.append(dict(op="grpo_max_completion_length", impl=impl, shape=_shape(args), metric="probes",
                         value=str(len(probes)), unit="count"))
        if lo:
            rows += step_rows(probes[lo], args, lo)
        run.save(rows)


def plot(rows, path):
    cpu = any(r["device"].startswith("cpu") for r in rows)
    harness.grouped_bars([r for r in rows if r["op"] == "grpo_step_fwd_bwd"], path,
                         [("peak_step_mem_mib", "peak memory of one step above the model (MiB)"),
                          ("step_time_ms", "step time, fwd + bwd (ms)")],
                         group=lambda r: (r["device"], r["shape"]), series=lambda r: r["impl"], sort=True, fmt="%.0f",
                         order=[i for i in VARIANTS if any(r["impl"] == i for r in rows)],
                         tick=lambda g: f"{g[1].replace(',', ' ', 3)}\n{g[0][:40]}",
                         title="CPU: host memory is device memory, offload cannot lower the peak there (forced copies; "
                               "measures overhead)" if cpu else "")


def parse_args(argv=None):
    p = harness.parser(__doc__, "step_memory.csv", worker=VARIANTS, device=True, resume=True)
    p.add_argument("--arch", default="smollm2-135m",
                   help="a name from grpo_accel.planning.architectures (tiny-llama for tests)")
    p.add_argument("--quant", default="none", choices=["none", "4bit"], help="4bit = QLoRA (CUDA + bitsandbytes)")
    p.add_argument("--preset", default=None, help="take a preset's model config fields (rope scaling) and router "
                   "loss coefficient, e.g. h200_gpt_oss_512k with --arch gpt-oss-20b")
    p.add_argument("--num-generations", type=int, default=4, help="G: rows in the step")
    p.add_argument("--prompt-length", type=int, default=64, help="P: prompt tokens per row")
    p.add_argument("--completion-length", type=int, default=256, help="T: completion tokens per row "
                   "(--find-max-t: the first probe)")
    p.add_argument("--reps", type=int, default=3, help="measured steps after the warm-up; time is their median")
    p.add_argument("--impls", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--find-max-t", action="store_true", help="bisect the longest T whose step fits, per impl")
    p.add_argument("--equal-lengths", action="store_true", help="every completion T tokens, no padding (default: "
                   "lengths spread from T/2 to T, right-padded as TRL batches them)")
    p.add_argument("--t-step", type=int, default=1024, help="--find-max-t resolution (tokens)")
    p.add_argument("--plan-probes", action=argparse.BooleanOptionalAction, default=True,
                   help="--find-max-t on CUDA: first probe at the planner's longest T (each probe at 256K costs "
                        "minutes of attention)")
    p.add_argument("--max-t", type=int, default=262144, help="--find-max-t upper bound (tokens)")
    p.add_argument("--ckpt-cache", type=Path, default=Path(tempfile.gettempdir()) / "grpo_accel_bench_ckpt",
                   help="--quant 4bit: where the random bf16 checkpoint is saved once per arch")
    p.add_argument("--cpu-mmap-threshold", type=int, default=128 << 10,
                   help="CPU: glibc MALLOC_MMAP_THRESHOLD_ for the workers, so peak RSS follows live tensors "
                        "(0 = glibc's dynamic default, whose retained free memory dominates the RSS peak)")
    return harness.parse(p, argv, worker)


def main(argv=None):
    args = parse_args(argv)
    import torch

    run = harness.Results.of(args, ("torch", "trl", "transformers"), plot)
    if args.quant == "4bit":
        try:
            import bitsandbytes  # noqa: F401
            ok = args.device == "cuda" and torch.cuda.is_available()
        except ImportError:
            ok = False
        if not ok:
            print("skipped: --quant 4bit (QLoRA) needs a CUDA GPU and bitsandbytes (pip install 'grpo_accel[qlora]'); "
                  "nothing measured, nothing written. Run without --quant for LoRA.", flush=True)
            return
    (find_max_t if args.find_max_t else run_steps)(args, run)
    run.finish()


if __name__ == "__main__":
    harness.run(main)
