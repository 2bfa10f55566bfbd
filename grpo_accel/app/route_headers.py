"""The "Generation route:" lines of each GPU preset's YAML header: the route the planner chose and the routes weighed.

    python -m grpo_accel.app.route_headers            # print every preset's lines
    python -m grpo_accel.app.route_headers --write    # rewrite them in accelerate_configs/*.yaml

tests/test_routes.py checks each YAML holds exactly these lines, so a planner change that moves a number fails there
until the headers are rewritten.
"""

from __future__ import annotations

import sys
import textwrap

from grpo_accel.core import dtypes
from grpo_accel.core.units import GIB
from grpo_accel.planning.generation import kv_bytes_per_token, kv_cache_sequences
from grpo_accel.planning.routes import COLOCATED, PINNED_STACK

HEADER_START, HEADER_INDENT = "# Generation route: ", "#   "


def weighed_routes(preset) -> list[tuple[str, object]]:
    """(label, plan) of the preset's own route first, then each alternative a user of its GPU would weigh: the other
    training precision's colocated route (QLoRA <-> bf16/fp16 LoRA), an FP8 engine copy, and without vLLM
    transformers' continuous batching and generate()."""
    route, _ = preset.route()
    out = [(route, preset.plan())]
    if route in ("vllm_4bit", "vllm_shared"):
        half = dtypes.long_name("bf16" if preset.model_dtype == "bf16" else "fp16")
        other = (f"{preset.model_dtype} LoRA + vllm_shared", dict(quantization="none", model_dtype=half)) \
            if route == "vllm_4bit" else ("QLoRA + vllm_4bit", dict(quantization="4bit"))
        out.append((other[0], preset.plan(other[1])))
        if route == "vllm_4bit":
            out.append(("vllm_fp8", preset.plan(generation="vllm_fp8")))
    if route not in ("generate", "continuous_batching"):  # without vLLM: transformers' two routes
        out.append(("without vLLM, continuous_batching", preset.plan(generation="continuous_batching")))
    if route != "generate":
        out.append(("generate()", preset.plan(generation="generate")))
    return out


def _describe(label: str, plan, gpu: int) -> str:
    text = f"{label} {plan.peak_gib:.1f}"
    inp = plan.inputs
    if plan.route in COLOCATED:
        try:
            seqs = kv_cache_sequences(plan, gpu)
            batch = inp["generation_batch"]
            text += f" (KV cache for {min(seqs, batch)} of {batch} sequences at once)"
        except ValueError:
            pass
    if plan.route == "continuous_batching":
        seqs = min(inp["paged_seqs"] or inp["generation_batch"], inp["generation_batch"])
        queued = ", the rest queued" if seqs < inp["generation_batch"] else ""
        text += (f" (a page pool of {plan.device['paged_kv_cache'] / GIB:.1f} GiB: {seqs} of "
                 f"{inp['generation_batch']} sequences at once{queued})")
    if plan.route == "generate":
        T = inp["max_prompt_length"] + inp["max_completion_length"]
        per_token = kv_bytes_per_token(plan.shape, 4 if inp["model_dtype"] == "fp32" else 2)
        text += (f" ({inp['generation_batch']} x {T:,} tokens x {per_token / 1024:.0f} KiB = "
                 f"{plan.device['generate_kv_cache'] / GIB:.1f} GiB of KV cache)")
    return text + ("" if plan.peak_bytes <= gpu else ": does not fit")


def generation_header(preset) -> str:
    """The preset's Generation route lines (without a trailing newline); empty for CPU presets."""
    if not preset.is_gpu:
        return ""
    route, why = preset.route(stack=PINNED_STACK)
    gpu = int(preset.min_gpu_mem_gib * GIB)
    weighed = "; ".join(_describe(label, plan, gpu) for label, plan in weighed_routes(preset))
    body = (f"{route}: {why}. The planner's route on this GPU with the vllm extra installed "
            f"(`grpo-accel plan --preset {preset.name} --stack pinned`). Weighed, peak GiB of "
            f"{preset.min_gpu_mem_gib:g}: {weighed}.")
    return "\n".join(textwrap.wrap(body, 118, initial_indent=HEADER_START, subsequent_indent=HEADER_INDENT,
                                   break_on_hyphens=False))


def rewrite_header(text: str, header: str) -> str:
    """`text` (a YAML) with its Generation route lines replaced by `header` (after the Memory lines if absent)."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_START)), None)
    if start is None:  # after the "#   The planner predicts a peak ..." line
        start = next(i for i, line in enumerate(lines) if "The planner predicts a peak" in line) + 1
        end = start
    else:
        end = start + 1
        while end < len(lines) and lines[end].startswith(HEADER_INDENT):
            end += 1
    return "\n".join(lines[:start] + ([header] if header else []) + lines[end:])


def main(argv: list[str]) -> int:
    from grpo_accel.app.presets import PRESETS

    for preset in PRESETS.values():
        header = generation_header(preset)
        if "--write" in argv and header:
            preset.yaml_path.write_text(rewrite_header(preset.yaml_path.read_text(), header))
        print(f"{preset.name}:\n{header}\n" if header else "", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
