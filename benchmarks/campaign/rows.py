"""The campaign's rows (run.py): what each measures, its goal, its sizes (GPU and --cpu-check), its time limit and the
estimate that limit covers. The headline rows come first and fit one 15-minute loan (a start, two calls), model
builds included; the longer rows follow, for later loans.

Estimates (no GPU time of these rows is measured yet; the one GPU point is the h100_110k preset: 2 steps in 62 s on
an H200 including its random checkpoint, issue 35): per worker process START_S (imports, CUDA context), plus the
model build (BUILD_S: random bf16 weights made on the GPU; 4-bit: loaded and quantized from the saved checkpoint),
plus the step FLOPs at TFLOPS: per token 6 N through the frozen weights (forward, checkpoint re-run, backward) and
per causal row 9 L T^2 d of attention (2 L T^2 d forward, x4.5 with re-run and backward). A row's limit is about
1.2-1.3x its estimate; a row that runs past it is killed, recorded as timed out and retried by the next call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import campaign.summary as summary

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the measuring scripts
CPU_LIMIT_S = 240  # a CPU check row: tiny sizes, but each process imports torch + transformers + TRL (~10 s here)
# one 15-minute loan: a start (0.5-2 min) and two calls on the warm machine (loan.sh: ~25 s of install and
# preflight each); the first loan (H200, 2026-11-26) measured 22-28 s of start + build per worker, not 15
HEADLINE_BUDGET_S = 680
TFLOPS = 300e12  # assumed sustained bf16 rate of a LoRA step on an H100 (dense peak 989); not measured yet
START_S = 17  # python + torch + transformers + TRL imports and the CUDA context, per worker (16-core host)
BUILD_S = {"bf16": 5, "4bit": 10}  # random init on the GPU; 4-bit load + quantize of the saved 16 GB checkpoint
CKPT_SAVE_S = 30  # the random Qwen3-8B checkpoint, made and written once (19 s of writing on the first loan)
# measured on the first loan (H200): a bf16 worker's wall less its step 22.5 s, a 4-bit one's 27.7 s


@dataclass(frozen=True)
class Row:
    name: str
    measures: str
    goal: str
    limit_s: int  # its own time limit on the GPU (an H100); the headline rows together stay under HEADLINE_BUDGET_S
    script: str  # under benchmarks/, or an absolute path
    csv: str  # the results CSV the script writes (under --results)
    op: str  # the op of the CSV rows that carry the row's figures
    judge: Callable
    args: tuple = ()  # flags of both modes (impls, reps, mode switches): the CPU check runs the GPU's wiring
    gpu: dict = field(default_factory=dict)  # sizes on the GPU, flag name -> value
    cpu: dict = field(default_factory=dict)  # tiny sizes for --cpu-check
    shape: str = ""  # the CSV shape's prefix, formatted with the sizes
    note: str = ""
    cpu_limit_s: int = CPU_LIMIT_S
    headline: bool = False
    estimate: tuple[float, str] = (0.0, "")  # (seconds on an H100, how they add up)
    cpu_args: tuple | None = None  # --cpu-check's flags where they differ (None: args); "skip": not run on CPU
    needs: tuple = ("torch", "transformers", "trl", "peft", "datasets", "matplotlib")  # imports, for --preflight
    vllm: bool = False  # runs vLLM: --cpu-check takes make test-vllm's interpreter (VLLM_PYTHON), skipped without

    def limit(self, cpu: bool) -> int:
        return self.cpu_limit_s if cpu else self.limit_s

    def sizes(self, cpu: bool) -> dict:
        return self.cpu if cpu else self.gpu

    def flags_of(self, cpu: bool) -> tuple:
        return self.cpu_args if cpu and self.cpu_args is not None else self.args

    def shape_prefix(self, cpu: bool) -> str:
        s = self.sizes(cpu)
        return self.shape.format(adapter="qlora-r16" if s.get("quant") == "4bit" else "lora-r16", **s)

    def script_path(self) -> Path:
        return Path(self.script) if os.path.isabs(self.script) else BENCH / self.script


# ------------------------------------------------------------------------------------------------------ estimates
def step_flops(arch: str, rows: list[int]) -> float:
    """FLOPs of one LoRA step over rows of these token counts (module docstring). A MoE runs its active parameters
    per token; a sliding layer's attention is T x window, so only the full layers count T^2."""
    from grpo_accel.planning.architectures import model_shape

    s = model_shape(arch)
    full = s.layers - s.sliding_layers
    return sum(6 * s.active_params * t + 9 * full * t * t * s.q_dim for t in rows)


def spread(G: int, T: int) -> list[int]:
    """bench_step_memory's completion lengths: T/2 .. T."""
    return [T] * G if G == 1 else [T // 2 + (T - T // 2) * i // (G - 1) for i in range(G)]


def estimate(arch: str, quant: str, variants: dict[str, list[int]], steps: int,
             extra: tuple[int, str] = (0, "")) -> tuple[float, str]:
    """(seconds, how) for variants {name: token count of each row}, each a process running `steps` steps;
    `extra`: (seconds, what) done once besides them (a checkpoint save)."""
    build = BUILD_S["4bit" if quant == "4bit" else "bf16"]
    compute = {k: steps * step_flops(arch, rows) / TFLOPS for k, rows in variants.items()}
    total = sum(compute.values()) + len(variants) * (START_S + build) + extra[0]
    how = (f"{len(variants)} x ({START_S} s start + {build} s build) + steps "
           + " + ".join(f"{k} {v:.0f} s" for k, v in compute.items()) + f" at {TFLOPS / 1e12:.0f} TFLOP/s"
           + (f" + {extra[0]} s {extra[1]}" if extra[0] else ""))
    return total, how


_STEP = "{arch},{adapter},G={num_generations},P={prompt_length},T={completion_length},"
_TINY = dict(arch="tiny-llama", num_generations=2, prompt_length=4)
_MB1_G2 = ("G=2: at micro-batch 1 each row is its own forward + backward, so the peak does not grow with G (but "
           "for [G, T] buffers of MiBs) and the time ratio is per token; G=8 takes 4x as long.")
_QWEN_4BIT = ("qwen3-8b", "4bit")


PRESET_ENGINE = "h100_110k"
# a vLLM row's CPU check: 2-3 processes each importing vLLM (~30 s) and starting an engine; 240 s ran out with the
# two vLLM tiers sharing 2 cores (2026-11-27)
VLLM_CPU_LIMIT_S = 600
_ENGINE_NEEDS = ("torch", "transformers", "peft", "vllm", "matplotlib")
_ENGINE_NOTE = ("Each variant its own process; the engine as the trainer starts it (vllm_colocate.SharedVLLM: "
                "CUDA graphs and torch.compile on, so the first variant pays the compile; later ones reuse vLLM's "
                "cache). KV cache fixed at 8 GiB so engine cost - KV = the engine's runtime. Random weights rarely "
                "stop: EOS ignored, every sequence exactly C tokens.")


def engine_rows(cpu: bool) -> list[Row]:
    """Issue 43's rows a-c: the colocated engine on a GPU for the first time, first in a loan's order (the vLLM
    bundle's three calls bring it: ../shared/gpu/README.md)."""
    qwen = dict(arch="qwen3-8b", num_generations=8, prompt_length=128)
    tiny = dict(arch="tiny-llama-hd64", num_generations=2, prompt_length=8)  # vllm-cpu: no head_dim 16
    preset = "cpu" if cpu else PRESET_ENGINE  # the CPU check: the cpu preset on vllm-cpu, as preset_rows does
    return [
        Row("engine_shared", "the shared-weight engine on CUDA: Qwen3-8B shape bf16 LoRA r16, route vllm_shared vs "
            "its own copy (vllm_copy) vs no engine: storage, engine cost, log-prob gap after a push, decode G=8 at "
            "C=1K", "weights shared 1.0; engine cost ~ KV + runtime (below the copy's by ~ the 15 GiB of weights); "
            "gap <= the copy's; decode >= 0.9x the copy's", 560, "bench_engine.py", "engine.csv", "engine",
            summary.judge_engine, ("--variants", "generate", "shared", "copy", "--completion-lengths", "1024"), qwen,
            tiny, "{arch},", cpu_args=("--cpu-check", "--variants", "generate", "shared", "copy"), vllm=True,
            cpu_limit_s=VLLM_CPU_LIMIT_S,
            estimate=(520.0, "H200, 2026-11-28: generate 197 s (save, load, HF decode 8 x 1K at 48 tokens/s), "
                      "shared 159 s (engine load, compile + graphs, decode), the copy as the shared"),
            needs=_ENGINE_NEEDS, note=_ENGINE_NOTE),
        Row("engine_4bit", "the 4-bit engine (vllm_4bit, bitsandbytes in vLLM 0.26's tree) for QLoRA beside an NF4 "
            "training model: storage, engine cost, gap after a push, decode G=8 at C=1K",
            "the figures (no goal: the engine's own NF4 copy is the route's design)", 300, "bench_engine.py",
            "engine.csv", "engine", summary.judge_engine,
            ("--variants", "generate-4bit", "4bit", "--completion-lengths", "1024"), qwen, tiny, "{arch},",
            cpu_args="skip", vllm=True, needs=_ENGINE_NEEDS + ("bitsandbytes",),
            estimate=(240.0, "NF4 load + quantize 2 x 25 s + HF decode 40 s + engine start ~110 s"),
            note=_ENGINE_NOTE + " The CPU check skips it: vllm-cpu's 4-bit engine is tests/vllm_engine's QLoRA run."),
        Row("engine_decode_8k", "decode throughput at G=8, C=8K: shared-weight engine vs its own copy",
            "shared >= 0.9x the copy's tokens/s", 420, "bench_engine.py", "engine.csv", "engine",
            summary.judge_engine, ("--variants", "shared", "copy", "--completion-lengths", "8192"),
            dict(qwen, prompt_length=129), dict(tiny, prompt_length=9), "{arch},",
            # the CPU check skips it: engine_shared's check runs the same script with the same two variants (and
            # the judge's per-shape split is test_gpu_campaign's); only the lengths differ, and 155 s of CI's time
            cpu_args="skip", vllm=True, needs=_ENGINE_NEEDS,
            estimate=(360.0, "2 x (engine start ~60 s with the compile cache + 8 x 8K decode ~100 s)"),
            note=_ENGINE_NOTE + " P=129 keeps its CSV shape apart from engine_shared's. generate() is measured at 1K "
                 "only (8 x 8K of HF decode is minutes)."),
        Row(f"preset_{preset}+engine", f"the user's command, preset {preset}, 2 GRPO steps with real generation "
            "through the preset's colocated engine at 1K-token completions: time split, reserved vs the plan",
            "completes; planner (with the engine) within 10% of measured reserved", 360, "gpu_presets.py",
            "presets_gpu.csv", "preset_2_steps", summary.judge_preset,
            ("--presets", preset, "--completion-length", "1024", "--generation", "engine"),
            cpu_args=("--presets", "cpu", "--completion-length", "8", "--generation", "engine", "--cpu-check"),
            cpu_limit_s=VLLM_CPU_LIMIT_S,
            vllm=True, needs=Row.needs + ("accelerate", "deepspeed", "pydantic", "bitsandbytes", "vllm"),
            estimate=(300.0, "checkpoint (saved by step_32k, else 30 s) + NF4 load ~30 s + engine start ~110 s + 2 "
                      "steps of 8 x 1K decode (~30 s) and training"),
            note="The preset's route is vllm_4bit (the engine's own NF4 copy, vLLM 0.26's in-tree bitsandbytes)."),
        Row(f"engine_prefill_{PRESET_ENGINE}", f"the generation phase at full length: preset {PRESET_ENGINE}'s "
            "engine as the command sizes it holds one sequence of the run's whole length (prompt prefilled, 4 "
            "tokens decoded): peak reserved vs the plan's generation phase", "plan's generation phase within 10% of "
            "measured reserved", 420, "bench_engine_prefill.py", "engine_prefill.csv", "engine_prefill",
            summary.judge_engine_prefill, ("--preset", PRESET_ENGINE), dict(arch="qwen3-8b"),
            dict(arch="tiny-llama-hd64"), "{arch} ", cpu_args=("--cpu-check",), cpu_limit_s=VLLM_CPU_LIMIT_S,
            vllm=True, needs=_ENGINE_NEEDS + ("bitsandbytes", "accelerate", "pydantic"),
            estimate=(330.0, "checkpoint (saved) + NF4 load ~30 s + engine start ~110 s + a 110K-token prefill "
                      "(~9 PFLOP: ~60 s with NF4 dequantization) + the start-up checks"),
            note="One prompt of max_model_len - 4 random tokens; the trainer built by grpo_accel.app.runner, so the "
                 "engine's gpu_memory_utilization is the run's. Before the first step: no optimizer states (the "
                 "plan leaves them out too)."),
    ]


_UNSLOTH_NOTE = ("Unsloth 2026.10.9 in its own site (UNSLOTH_SITE: trl 1.15 there, 1.16 for ours; "
                 "benchmarks/campaign/unsloth_wheels.sh), used as its GRPO docs say: FastLanguageModel, "
                 "use_gradient_checkpointing='unsloth' (its own offloaded checkpoints), its patched GRPOTrainer, "
                 "fast_inference off. The step is bench_step_memory's (same fixed batch, compute_loss + backward) "
                 "through Unsloth's loss (its chunked log-softmax, row mini-batches). Not matched: padding by pad id "
                 "(Unsloth's rule), one micro-batch of G rows (Unsloth's) where ours runs micro-batch 1. "
                 "docs/unsloth.md. G=2: ours at micro-batch 1 is one row at a time, so its peak does not grow with G "
                 "and time compares per token; Unsloth's one micro-batch of G rows grows with G, so G=2 (to fit a "
                 "loan) is the comparison least favourable to us.")


def unsloth_rows() -> list[Row]:
    """Issue 44: Unsloth's GRPO step beside ours and tuned TRL, all three in the row's one call (--with-ours: the
    shapes of seeds_20k and step_32k, whose rows then skip what is measured at this sha), then its longest
    completion. GPU only: Unsloth refuses to import without one."""
    seeds = dict(arch="llama-3.1-8b", quant="none", num_generations=2, prompt_length=512, completion_length=19968)
    step32 = dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=32768)
    probe = dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=65536,
                 t_step=32768, max_t=262144)
    needs = ("torch", "matplotlib")  # the parent's; the worker's imports are --preflight's (its own site)
    return [
        Row("unsloth_20k", "Unsloth's GRPO step at the seeds' shape: Llama-3.1-8B LoRA bf16, 512 + 19968, G=2, after "
            "ours and tuned TRL at the same shape in the same call (--with-ours; seeds_20k then finds them measured)",
            "ours reserved <= 0.8x Unsloth's; time per token <= 1.1x", 300,
            "bench_unsloth.py", "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_unsloth,
            ("--reps", "1", "--with-ours"), seeds, {}, _STEP, cpu_args="skip", needs=needs,
            estimate=(175.0, "ours and TRL ~75 s (seeds_20k's 61 s and a measured step each) + 45 s Unsloth import "
                      "+ 30 s load + warm-up and one step ~15 s"), note=_UNSLOTH_NOTE),
        Row("unsloth_32k", "Unsloth's GRPO step, Qwen3-8B QLoRA, 64 + 32768, G=2, after ours and tuned TRL at the "
            "same shape in the same call (--with-ours; step_32k then finds them measured)",
            "ours reserved <= 0.8x Unsloth's; time per token <= 1.1x", 380, "bench_unsloth.py", "step_memory.csv",
            "grpo_step_fwd_bwd", summary.judge_unsloth, ("--reps", "1", "--with-ours"), step32, {}, _STEP,
            cpu_args="skip", needs=needs,
            estimate=(265.0, "ours and TRL with the checkpoint save ~155 s (step_32k's estimate) + 45 s import + "
                      "4-bit load 30 s + 2 steps ~30 s"),
            note=_UNSLOTH_NOTE),
        Row("unsloth_max_t", "Unsloth's longest completion, Qwen3-8B QLoRA, G=2: 64K, 96K, 128K, ... each probe its "
            "own process, until one fails", "ours (max_t_ours: 256K) >= 1.5x Unsloth's longest", 560,
            "bench_unsloth.py", "step_memory.csv", "grpo_max_completion_length", summary.judge_unsloth_max_t,
            ("--find-max-t", "--reps", "0"), probe, {},
            "{arch},{adapter},G={num_generations},P={prompt_length},T<=max,step={t_step},", cpu_args="skip",
            needs=needs, note=_UNSLOTH_NOTE + " Probes past what the limit holds are the next call's (--resume)."),
    ]


def cb_rows(cpu: bool) -> list[Row]:
    """Issue 45 (5): route continuous_batching (transformers' generate_batch on the trainer's own weights, a planned
    page pool) on a GPU: against generate() at 1K and 8K, then the h100_110k preset's command on it. No vLLM."""
    preset = "cpu" if cpu else PRESET_ENGINE  # the CPU check: the cpu preset, as the engine's preset row
    return [
        Row("cb_generation", "route continuous_batching vs HF generate(), Qwen3-8B shape bf16 LoRA r16 (random B), "
            "G=8 (one prompt x 8), P=128, C=1K and 8K, EOS off: decode tokens/s and the generation's peak vs the "
            "plan's pool + working set", "the figures; paged peak allocated within 10% of its plan", 560,
            "bench_continuous_batching.py", "continuous_batching.csv", "cb_generation", summary.judge_cb_generation,
            ("--variants", "paged", "generate", "--completion-lengths", "1024", "8192", "--timeout-s", "540"),
            dict(arch="qwen3-8b", dtype="bfloat16", num_generations=8, prompt_length=128),
            # the CPU check on random tiny weights: an offline host has no embedded model to fetch (the GPU path's)
            dict(arch="tiny-llama", num_generations=2, prompt_length=8), "{arch},",
            cpu_args=("--cpu-check", "--variants", "paged", "generate", "--completion-lengths", "8"),
            estimate=(520.0, "4 processes x (17 s start + ~15 s load of the saved bf16 checkpoint) + 1K: generate 8 x "
                      "1K ~40 s, paged ~60 s + 8K: generate ~370 s, paged ~550 s (36 layers read back a pool of "
                      "66K tokens per step): ~1,150 s, two or three calls; this limit covers the first"),
            note="Each (variant, C) its own process, written as it ends, C=1K first; with --resume a call killed at "
                 "the limit leaves the next only what is left; a variant past --timeout-s 540 is recorded as timed "
                 "out, not retried. The pool from paged_config (the plan) for all 8 sequences; the plan's terms are "
                 "generation_terms'. Peaks are above the state before the timed call (the model and its adapter), "
                 "allocated and reserved."),
        Row(f"preset_{preset}+cb", f"the user's command, preset {preset}, 2 GRPO steps generating through route "
            "continuous_batching (--use_vllm false --use_transformers_continuous_batching true) at 1K-token "
            "completions: time split, reserved vs the plan", "completes; planner (route continuous_batching) within "
            "10% of measured reserved", 420, "gpu_presets.py", "presets_gpu.csv", "preset_2_steps",
            summary.judge_preset, ("--presets", preset, "--completion-length", "1024", "--generation",
                                   "continuous_batching"),
            cpu_args=("--presets", "cpu", "--completion-length", "8", "--generation", "continuous_batching",
                      "--cpu-check"),
            needs=Row.needs + ("accelerate", "deepspeed", "pydantic", "bitsandbytes"),
            estimate=(330.0, "checkpoint (saved by cb_generation's bf16 one) + NF4 load ~30 s + 2 steps of paged "
                      "generation from the NF4 weights (~100 s each at 1K) and training"),
            note="Planned on a stack without vLLM (gpu_presets.GPU_HOST_STACK), which must give route "
                 "continuous_batching (gpu_presets refuses another); the preset's pool holds the sequences its "
                 "plan fits (paged_sequences), the rest wait in transformers' queue."),
    ]


def _headline() -> list[Row]:
    step32 = dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=32768)
    seeds = dict(arch="llama-3.1-8b", num_generations=2, prompt_length=512, completion_length=19968)
    long_t = dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=65536)
    pack = dict(arch="llama-3.1-8b", num_generations=8, prompt_length=256, completion_length=8192)
    shared = dict(arch="qwen3-8b", prompt_lengths=4096, completion_lengths=512, generations_grid=8, offload="true")
    real = lambda s: [s["prompt_length"] + c for c in spread(s["num_generations"], s["completion_length"])]  # noqa: E731
    padded = lambda s: [s["prompt_length"] + s["completion_length"]] * s["num_generations"]  # noqa: E731
    return [
        Row("step_32k", "one GRPO step, Qwen3-8B QLoRA, G=2, T=32K: ours at micro-batch 1 vs tuned TRL, side by "
            "side", "peak reserved <= 0.5x trl_tuned's, time per token <= 1.1x", 200, "bench_step_memory.py",
            "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_step_32k,
            ("--impls", "trl_tuned", "ours_mb1", "--reps", "1"), step32, dict(_TINY, completion_length=8), _STEP,
            headline=True, estimate=estimate(*_QWEN_4BIT, {"trl_tuned": padded(step32), "ours_mb1": real(step32)}, 2,
                                             extra=(CKPT_SAVE_S, "checkpoint save")),
            cpu_args=("--impls", "trl_tuned", "ours_mb1", "ours_head_offload", "--reps", "1"),
            needs=Row.needs + ("bitsandbytes", "triton"),
            note=_MB1_G2 + " The CPU check runs ours_head_offload too (the whole batch at once: micro-batch 1 gives "
                 "its loss). --reps 1: a warm-up and one measured step. trl_tuned is the fair baseline only with "
                 "transformers >= 5.20 (its activation offload); the GPU hosts have 5.17: bring a newer "
                 "transformers wheel, or the verdict is marked weaker than fair."),
        Row("seeds_20k", "the seeds' table: Llama-3.1-8B LoRA bf16, 20K context (512 + 19968), G=2",
            "peak reserved with weights <= 27 GB (half Unsloth's 54.3 GB)", 100, "bench_step_memory.py",
            "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_seeds_20k,
            ("--impls", "trl_tuned", "ours_mb1", "--reps", "0"), seeds,
            dict(_TINY, prompt_length=8, completion_length=12), _STEP, headline=True,
            estimate=estimate("llama-3.1-8b", "none", {"trl_tuned": padded(seeds), "ours_mb1": real(seeds)}, 1),
            # the CPU check skips it: step_32k's runs the same script with both impls (and a third), gpt_oss_128k's
            # --reps 0; only the sizes differ, and ~40 s of CI's time
            cpu_args="skip", needs=Row.needs + ("triton",),
            note=_MB1_G2 + " The seeds' table is at G=8: the same peak. --reps 0: the first step's peak (a memory "
                 "goal; no time is compared)."),
        Row("long_t_64k", "one long completion, Qwen3-8B QLoRA, T=64K: does a step fit, ours at micro-batch 1",
            "fits (a probe on the way to 256K; the planner's error at long T)", 130, "bench_step_memory.py",
            "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_max_t_ours, ("--impls", "ours_mb1", "--reps", "0"),
            long_t, dict(_TINY, completion_length=16), _STEP, headline=True,
            estimate=estimate(*_QWEN_4BIT, {"ours_mb1": real(long_t)}, 1), cpu_args="skip",  # as seeds_20k's
            needs=Row.needs + ("bitsandbytes", "triton"),
            note=_MB1_G2 + " One probe at 65536 (a step at 262144 is ~7 minutes of attention: a later row)."),
        Row("packing", "padded vs packed rows, uniform completion lengths, Llama-3.1-8B LoRA bf16, G=8, T=8192",
            ">= 1.5x faster, <= 0.7x peak", 130, "bench_packing.py", "packing.csv", "grpo_step_fwd_bwd",
            summary.judge_packing, ("--mixes", "uniform", "--reps", "1", "--offload", "true"), pack,
            dict(_TINY, num_generations=4, completion_length=8),
            "{arch},lora-r16,G={num_generations},P<={prompt_length},T<={completion_length},uniform,", headline=True,
            # packed: about half the padded tokens (uniform 5-100% of T, one row at T)
            estimate=estimate("llama-3.1-8b", "none", {"padded": padded(pack), "packed": [4500] * 8}, 2),
            needs=Row.needs + ("triton",), note="G=8: the padding a batch carries depends on its spread of lengths."),
        Row("shared_prompt", "the prompt once per group vs G times, Qwen3-8B LoRA bf16, P=4K, C=512, G=8: shared vs "
            "packed", ">= 3x faster, <= 1/3 peak of packed (issue 28's goal, at G=8)", 110, "bench_shared_prompt.py",
            "shared_prompt.csv", "grpo_policy_step", summary.judge_shared_prompt,
            ("--impls", "shared", "packed", "--reps", "1"), shared,
            dict(arch="tiny-llama", prompt_lengths=16, completion_lengths=8, generations_grid=2),
            "{arch},lora-r16,2x{generations_grid} rows,P={prompt_lengths},C<={completion_lengths},", headline=True,
            estimate=estimate("qwen3-8b", "none", {"shared": [4096 + 8 * 384] * 2, "packed": [4096 + 384] * 16}, 2),
            cpu_args=("--impls", "shared", "packed", "trl_padded", "--reps", "1"), needs=Row.needs + ("triton",),
            note="Host memory: packed offloads 2 x 8 x ~4.5K tokens: 36 layer inputs of 0.55 GiB, each in a 1 GiB "
                 "pinned block (36 GiB of 128 GiB). Issue 28's G=16, P=8K, C=1K needs 36 blocks of 4 GiB (144 GiB; "
                 "its packed worker was killed by signal 9 on an H200 host): G=8 here, and P/C = 8 as there at half "
                 "the tokens, to fit the headline minutes. The CPU check runs trl_padded too (the later row's)."),
    ]


def _later() -> list[Row]:
    max_t = dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=262144)
    shared = dict(arch="qwen3-8b", prompt_lengths=8192, completion_lengths=1024, generations_grid=8, offload="true")
    return [
        Row("max_t_ours", "longest completion, Qwen3-8B QLoRA: does one step at T=256K fit, ours at micro-batch 1",
            "fits at T >= 256K", 560, "bench_step_memory.py", "step_memory.csv", "grpo_step_fwd_bwd",
            summary.judge_max_t_ours, ("--impls", "ours_mb1", "--reps", "0"), max_t, dict(_TINY, completion_length=16),
            _STEP, estimate=estimate(*_QWEN_4BIT, {"ours_mb1": [64 + c for c in spread(2, 262144)]}, 1),
            cpu_args="skip", needs=Row.needs + ("bitsandbytes", "triton"),
            note=_MB1_G2 + " One probe at 262144: a lower bound, not a bisection. The CPU check skips it: "
                 "long_t_64k runs the same flags."),
        Row("max_t_trl", "longest completion, Qwen3-8B QLoRA: tuned TRL bisected (first probe: the planner's)",
            "ours >= 2x trl_tuned's longest", 540, "bench_step_memory.py", "step_memory.csv",
            "grpo_max_completion_length", summary.judge_max_t_trl, ("--find-max-t", "--impls", "trl_tuned"),
            dict(arch="qwen3-8b", quant="4bit", num_generations=2, prompt_length=64, completion_length=65536,
                 t_step=16384, max_t=196608),
            dict(_TINY, completion_length=8, t_step=8, max_t=16),
            "{arch},{adapter},G={num_generations},P={prompt_length},T<=max,step={t_step},",
            needs=Row.needs + ("bitsandbytes", "triton"),
            note=_MB1_G2 + " Capped at 196608 (past 131072 the 2x goal is missed either way); each probe a fresh "
                 "process, so no estimate beyond its limit."),
        Row("shared_prompt_8k", "the prompt once per group vs G times, Qwen3-8B LoRA bf16, P=8K, C=1K, G=8: shared "
            "vs packed vs TRL's padded rows", ">= 3x faster, <= 1/3 peak of packed (issue 28's goal, at G=8)", 300,
            "bench_shared_prompt.py", "shared_prompt.csv", "grpo_policy_step", summary.judge_shared_prompt,
            ("--impls", "shared", "packed", "trl_padded", "--reps", "1"), shared, {}, "{arch},lora-r16,2x"
            "{generations_grid} rows,P={prompt_lengths},C<={completion_lengths},", cpu_args="skip",
            estimate=estimate("qwen3-8b", "none", {"shared": [8192 + 8 * 768] * 2, "packed": [8192 + 768] * 16,
                                                   "trl_padded": [8192 + 1024] * 16}, 2),
            needs=Row.needs + ("triton",),
            note="Issue 28's shape at G=8: packed offloads 2 x 8 x ~9K tokens, 36 pinned blocks of 2 GiB (72 GiB "
                 "of 128 GiB; G=16 would need 144 GiB). The CPU check skips it: shared_prompt runs the same impls."),
    ]


def gpt_oss_rows() -> list[Row]:
    """Issue 36's GPU step: gpt-oss-20b (random weights of the real shape) with the h200_gpt_oss_512k preset's
    settings (YaRN factor 128, no router loss, offload, tiles), one step at micro-batch 1 against the planner. 128K
    first (a minute of attention; fits an H100), then 384K: past the seeds' 380K and what one call can hold (the
    preset's own 523,776 is ~1.8x the attention of 384K, ~9 minutes of steps at 300 TFLOP/s: past a call)."""
    rows = []
    for name, T, limit in (("gpt_oss_128k", 131072, 150), ("gpt_oss_384k", 393216, 520)):
        sizes = dict(arch="gpt-oss-20b", num_generations=2, prompt_length=512, completion_length=T)
        rows.append(Row(
            name, f"one GRPO step of gpt-oss-20b (random weights, real shape) at T={T}, the h200_gpt_oss_512k "
            "preset's settings, ours at micro-batch 1", "fits; planner within 10% of reserved", limit,
            "bench_step_memory.py", "step_memory.csv", "grpo_step_fwd_bwd", summary.judge_step_fits,
            ("--impls", "ours_mb1", "--reps", "0", "--preset", "h200_gpt_oss_512k"), sizes,
            dict(arch="tiny-gpt-oss", num_generations=2, prompt_length=4, completion_length=16), _STEP,
            estimate=estimate("gpt-oss-20b", "none", {"ours_mb1": [512 + c for c in spread(2, T)]}, 1),
            cpu_args=None if T == 131072 else "skip",
            note=_MB1_G2 + " The preset runs G=8 the same way. --reps 0: the first step's peak. Training only: "
                 "generation at this length needs the colocated engine, absent on the GPU hosts."))
    return rows


def preset_rows(cpu: bool, gpu_props) -> tuple[list[Row], list[tuple[str, str]]]:
    """A row per single-GPU preset this GPU can run (the cpu preset for the CPU check), h100_110k first; and the
    ones it cannot, with why."""
    from grpo_accel.app.presets import PRESETS, check_preset_fits_gpu

    names = ["cpu"] if cpu else sorted((n for n, p in PRESETS.items() if p.is_gpu and p.num_processes == 1),
                                       key=lambda n: (n != "h100_110k", -PRESETS[n].min_gpu_mem_gib))
    rows, skipped = [], []
    for name in names:
        if not cpu:
            try:
                check_preset_fits_gpu(PRESETS[name], gpu_props)
            except Exception as exc:
                skipped.append((f"preset_{name}", str(exc)))
                continue
        first = name in ("h100_110k", "cpu")
        needs = Row.needs + ("accelerate", "deepspeed", "pydantic") + (
            ("bitsandbytes",) if PRESETS[name].quantization == "4bit" else ())
        rows.append(Row(
            f"preset_{name}", f"preset {name}: 2 GRPO steps through accelerate launch, vs the planner",
            "completes; planner within 10% of measured reserved", 170 if first else 420, "gpu_presets.py",
            "presets_gpu.csv", "preset_2_steps", summary.judge_preset,
            ("--presets", name, "--completion-length", "8" if cpu else "128" if first else "1024")
            + (("--cpu-check",) if cpu else ()), needs=needs,
            estimate=(140.0, "the first loan (H200): past 100 s, its first step 31.5 s after a 19 s checkpoint "
                      "write; 62 s on the first GPU point") if first else (0.0, ""),
            note="128-token completions, as the first GPU point (issue 35), so the planner's error is compared at "
                 "the same completion length (prompts are longer: a byte-level tokenizer, random_models.py)."
                 if name == "h100_110k" else ""))
    return rows, skipped


def campaign_rows(cpu: bool, gpu_props) -> tuple[list[Row], list[tuple[str, str]]]:
    """The engine rows first (issue 43: the engine has never run on a GPU), Unsloth's (issue 44: a and b, then its
    longest completion; they pair with seeds_20k and step_32k), route continuous_batching's (issue 45), then the
    headline rows (step_32k saves
    the Qwen3-8B checkpoint the other 4-bit rows and the presets load), then the h100_110k preset (a GPU point before
    the campaign; on the first loan it ran past its limit), the gpt-oss rows, the longer rows, the other presets.
    --cpu-check leaves out the rows marked cpu_args="skip"."""
    presets, skipped = preset_rows(cpu, gpu_props)
    rows = (engine_rows(cpu) + unsloth_rows() + cb_rows(cpu) + _headline() + presets[:1] + gpt_oss_rows() + _later()
            + presets[1:])
    return [r for r in rows if not (cpu and r.cpu_args == "skip")], skipped
