"""Generation routes: how a run's completions are generated, and which one a run gets on a given stack.

    route, why = choose_route(use_vllm=True, vllm_mode="colocate", quantization="4bit", lora_r=16, stack=PINNED_STACK)
    # ("vllm_4bit", "colocated vLLM quantizing its own 4-bit NF4 copy (bitsandbytes: ...) ...")

A route decides what sits on the GPU while generating, so the planner (`memory.plan_memory(generation=...)`) sizes
the route that will run, not the one that was asked for. The rule, per training precision, first route that the
stack has wins:
  LoRA on bf16/fp16/fp32 weights  vllm_shared (the engine's weights are the trainer's: one copy, no mismatch)
  QLoRA (4-bit NF4 base)          vllm_4bit (the engine quantizes its own NF4 copy of the same checkpoint, NF4 with
                                  double quantization as the trainer; vLLM quantizes its fused qkv / gate_up tensors
                                  whole, so the scales differ a little: 0.73 nats max on the self-check text on
                                  CPU bf16, vs 0.20 for two unquantized bf16 copies; bitsandbytes in vLLM 0.26's
                                  tree, vllm-bnb-plugin on 0.32), then
                                  vllm_fp8 (an FP8 copy, CUDA vLLM only)
  full fine-tuning                vllm_copy (its own copy, every weight pushed, asleep while training on CUDA)
  vllm_mode="server"              vllm_server (nothing on these GPUs)
then `continuous_batching` (transformers' paged KV cache on the trainer's own weights: no copy, no push, a pool of
planned pages, requests queued while it is full; needs transformers >= 5.8): where use_vllm is on and the stack
has no vLLM route, or where use_vllm is off and use_transformers_continuous_batching on (TRL's option); and
`generate` (transformers' generate(), TRL's non-vLLM path: the whole generation batch's KV cache at once) when
use_vllm and use_transformers_continuous_batching are both off, or the stack has none of the above. This module
is pure: the stack is probed at run time
(`grpo_accel.generation.vllm_setup.local_stack`), and presets are planned for PINNED_STACK (a CUDA machine with
the `vllm` extra installed: vLLM 0.32 with vllm-bnb-plugin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTES = {
    "vllm_shared": "colocated vLLM sharing the trainer's base weights (one copy), adapter pushed from memory",
    "vllm_4bit": "colocated vLLM quantizing its own 4-bit NF4 copy (bitsandbytes: in vLLM 0.26's tree, "
                 "vllm-bnb-plugin on 0.32), adapter pushed from memory",
    "vllm_fp8": "colocated vLLM with its own FP8 copy (CUDA), adapter pushed from memory",
    "vllm_copy": "colocated vLLM with its own copy (full fine-tuning), every weight pushed, asleep while training",
    "vllm_server": "a vLLM server machine generates (`vllm serve` loading the adapter each step for LoRA, `trl "
                   "vllm-serve` for full fine-tuning): nothing of it on these GPUs",
    "continuous_batching": "transformers' continuous batching on the trainer's own weights: a paged KV cache of "
                           "planned pages, requests queued while it is full",
    "generate": "transformers' generate(): the whole generation batch's KV cache at once",
}
COLOCATED = ("vllm_shared", "vllm_4bit", "vllm_fp8", "vllm_copy")
# What each colocated route asks of vLLM: EngineArgs' quantization (None: the checkpoint's dtype).
ENGINE_QUANTIZATION = {"vllm_shared": None, "vllm_4bit": "bitsandbytes", "vllm_fp8": "fp8", "vllm_copy": None}
VLLM_INSTALL = "pip install 'grpo_accel[vllm]' (CPU: make test-vllm's venv)"
BNB_PLUGIN_INSTALL = "pip install --no-deps vllm-bnb-plugin==0.0.3 'bitsandbytes>=0.48.1'"
PAGED_TRANSFORMERS = "5.8.0"  # the first transformers with generate_batch's ContinuousBatchingConfig (TRL's check)


@dataclass(frozen=True)
class Stack:
    """What the generating machine has: whether vLLM (a supported version) imports, whether it lists bitsandbytes
    quantization (vllm-bnb-plugin and bitsandbytes installed), whether CUDA is there; `missing` says why not, for
    the lines that name the fix."""

    vllm: bool
    bnb_4bit: bool
    cuda: bool
    missing: dict = field(default_factory=dict)  # "vllm" / "bnb_4bit" / "continuous_batching" -> the fix
    continuous_batching: bool = True  # transformers >= PAGED_TRANSFORMERS (pyproject pins one)

    def lacks(self, route: str) -> str | None:
        """Why this stack cannot run `route` (None: it can)."""
        if route in ("generate", "vllm_server"):
            return None
        if route == "continuous_batching":
            return None if self.continuous_batching else self.missing.get("continuous_batching") or (
                f"this transformers has no continuous batching. Fix: pip install 'transformers>={PAGED_TRANSFORMERS}'")
        if not self.vllm:
            return self.missing.get("vllm") or f"vLLM is not installed. Fix: {VLLM_INSTALL}"
        if route == "vllm_4bit" and not self.bnb_4bit:
            return self.missing.get("bnb_4bit") or (
                f"this vLLM has no bitsandbytes quantization (since 0.28 it lives in vllm-bnb-plugin). Fix: "
                f"{BNB_PLUGIN_INSTALL}")
        if route == "vllm_fp8" and not self.cuda:
            return "vLLM's FP8 weights need CUDA"
        return None


PINNED_STACK = Stack(vllm=True, bnb_4bit=True, cuda=True)  # a GPU machine with the vllm extra: what presets plan for


def candidate_routes(*, use_vllm: bool, vllm_mode: str = "colocate", quantization: str = "none",
                     lora_r: int = 16, continuous_batching: bool = False) -> list[str]:
    """The routes a run with these settings may take, best first (see the module docstring); `generate` last.
    `continuous_batching`: TRL's use_transformers_continuous_batching, asked for by the run."""
    if not use_vllm:
        return ["continuous_batching", "generate"] if continuous_batching else ["generate"]
    if vllm_mode == "server":
        return ["vllm_server"]
    if quantization == "4bit":
        return ["vllm_4bit", "vllm_fp8", "continuous_batching", "generate"]
    return ["vllm_shared" if lora_r > 0 else "vllm_copy", "continuous_batching", "generate"]


def choose_route(*, use_vllm: bool, vllm_mode: str = "colocate", quantization: str = "none", lora_r: int = 16,
                 vllm_share_weights: bool = True, stack: Stack = PINNED_STACK,
                 continuous_batching: bool = False) -> tuple[str, str]:
    """(route, why): the first candidate this stack has. `vllm_share_weights=False` turns vllm_shared into an
    engine holding its own copy (vllm_copy's terms, the adapter still pushed)."""
    tried = []
    for route in candidate_routes(use_vllm=use_vllm, vllm_mode=vllm_mode, quantization=quantization, lora_r=lora_r,
                                  continuous_batching=continuous_batching):
        lacking = stack.lacks(route)
        if lacking is None:
            if route == "vllm_shared" and not vllm_share_weights:
                return "vllm_copy", "colocated vLLM with its own copy: --vllm_share_weights false"
            return route, ROUTES[route] + (f", because {'; '.join(tried)}" if tried else "")
        if not any(lacking in t for t in tried):  # vLLM missing stops every colocated route: say it once
            tried.append(f"no {route}: {lacking}")
    raise AssertionError("generate is always a candidate")  # pragma: no cover


__all__ = ["BNB_PLUGIN_INSTALL", "COLOCATED", "ENGINE_QUANTIZATION", "PAGED_TRANSFORMERS", "PINNED_STACK", "ROUTES",
           "Stack",
           "VLLM_INSTALL", "candidate_routes", "choose_route"]
