"""Generation routes: the plan sizes the route that will run (grpo_accel/planning/routes.py), every GPU preset's
route exists in the pinned stack and fits, and a route that cannot fit is refused with the fix.

    pytest tests/test_routes.py
"""

import sys

import pytest

from grpo_accel.app import cli
from grpo_accel.app.presets import PRESETS
from grpo_accel.app.route_headers import generation_header
from grpo_accel.core.units import GIB
from grpo_accel.planning.routes import PINNED_STACK, Stack, choose_route

# Qwen3-8B's KV cache per token, from its config (issue 34): 36 layers x 8 KV heads x 128 x (K and V) x 2 bytes
QWEN3_8B_KV_PER_TOKEN = 36 * 8 * 128 * 2 * 2


def _plan_output(monkeypatch, capsys, *flags):
    """(exit code, output from the plan's first line on: libraries may print before it)."""
    rc = cli.main(["plan", *flags])
    out = capsys.readouterr().out
    return rc, out[out.index("preset "):]


def _no_continuous_batching(monkeypatch):
    """This machine's stack as with a transformers older than 5.8: no continuous batching."""
    from grpo_accel.generation import continuous_batching

    monkeypatch.setattr(continuous_batching, "continuous_batching_missing",
                        lambda: "transformers 5.7 has no continuous batching. Fix: pip install 'transformers>=5.8.0'")


def test_plan_without_vllm_takes_continuous_batching_and_fits(monkeypatch, capsys):
    """Issue 45: without vLLM the h100_110k run generates with transformers' continuous batching on its own weights;
    the page pool holds what the GPU leaves (3 of its 8 full-length sequences at once) and the run fits at its full
    completion length, where generate() (the whole batch's cache at once) was refused."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    rc, out = _plan_output(monkeypatch, capsys, "--preset", "h100_110k")
    assert rc == 0 and "generation route continuous_batching" in out.splitlines()[0], out
    assert "vLLM is not installed. Fix: pip install 'grpo_accel[vllm]'" in out and "fits:" in out
    seqs = int(out.split("page pool for ")[1].split()[0])
    assert 1 <= seqs < 8 and f"{seqs} of 8 full-length sequences at once" in out
    pool_gib = seqs * (512 + 110_000 + 255) // 256 * 256 * QWEN3_8B_KV_PER_TOKEN / GIB
    assert abs(float(out.split("paged_kv_cache")[1].split()[0]) - pool_gib) < 0.05  # the arithmetic, 2 trash pages


def test_plan_without_vllm_sizes_generate_and_refuses(monkeypatch, capsys):
    """Issue 34: on a machine without vLLM (and, since issue 45, without continuous batching) the h100_110k run
    generates with generate(), whose KV cache holds the whole generation batch (8 x 110,512 tokens, ~121 GiB): the
    plan must say so and refuse, naming the package and the longest completion that fits this route."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ModuleNotFoundError, as with no vLLM
    _no_continuous_batching(monkeypatch)
    rc, out = _plan_output(monkeypatch, capsys, "--preset", "h100_110k")
    first = out.splitlines()[0]
    assert rc == 1, out
    assert "generation route generate" in first
    assert "vLLM is not installed. Fix: pip install 'grpo_accel[vllm]'" in out
    assert "does not fit" in out and "--max_completion_length " in out
    kv_gib = 8 * (512 + 110_000) * QWEN3_8B_KV_PER_TOKEN / GIB
    assert f"generate_kv_cache{kv_gib:>19.2f}" in out  # the plan's term is the arithmetic above
    # the same run planned for the preset's machine (the vllm extra installed): the 4-bit engine, which fits
    rc, out = _plan_output(monkeypatch, capsys, "--preset", "h100_110k", "--stack", "pinned")
    assert rc == 0 and "generation route vllm_4bit" in out.splitlines()[0] and "fits:" in out


def test_the_longest_completion_named_fits_the_generate_route(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    _no_continuous_batching(monkeypatch)
    _, out = _plan_output(monkeypatch, capsys, "--preset", "h100_110k")
    longest = int(out.split("--max_completion_length ")[1].split()[0])
    rc, out = _plan_output(monkeypatch, capsys, "--preset", "h100_110k", "--max_completion_length", str(longest))
    assert rc == 0 and "fits:" in out and "generation route generate" in out.splitlines()[0]
    rc, _ = _plan_output(monkeypatch, capsys, "--preset", "h100_110k", "--max_completion_length", str(longest + 1024))
    assert rc == 1


NO_PLUGIN_GPU = Stack(vllm=True, bnb_4bit=False, cuda=True)
NO_PLUGIN_CPU = Stack(vllm=True, bnb_4bit=False, cuda=False)
NO_VLLM = Stack(vllm=False, bnb_4bit=False, cuda=True)
NO_VLLM_NO_CB = Stack(vllm=False, bnb_4bit=False, cuda=True, continuous_batching=False)


@pytest.mark.parametrize("settings, stack, route", [
    (dict(quantization="4bit"), PINNED_STACK, "vllm_4bit"),
    (dict(quantization="4bit"), Stack(vllm=True, bnb_4bit=True, cuda=False), "vllm_4bit"),  # the plugin runs on CPU
    (dict(quantization="4bit"), NO_PLUGIN_GPU, "vllm_fp8"),
    (dict(quantization="4bit"), NO_PLUGIN_CPU, "continuous_batching"),
    (dict(quantization="4bit"), NO_VLLM, "continuous_batching"),
    (dict(quantization="4bit"), NO_VLLM_NO_CB, "generate"),
    (dict(), PINNED_STACK, "vllm_shared"),
    (dict(), NO_PLUGIN_CPU, "vllm_shared"),
    (dict(), NO_VLLM, "continuous_batching"),
    (dict(), NO_VLLM_NO_CB, "generate"),
    (dict(use_vllm=False, continuous_batching=True), NO_VLLM, "continuous_batching"),  # TRL's option, asked for
    (dict(vllm_share_weights=False), PINNED_STACK, "vllm_copy"),
    (dict(lora_r=0), PINNED_STACK, "vllm_copy"),
    (dict(vllm_mode="server"), NO_VLLM, "vllm_server"),
    (dict(use_vllm=False), PINNED_STACK, "generate"),
])
def test_route_rule(settings, stack, route):
    chosen, why = choose_route(**{"use_vllm": True, **settings}, stack=stack)
    assert chosen == route
    if route in ("generate", "continuous_batching") and settings.get("use_vllm", True):
        assert "Fix: pip install" in why  # a fallback names what to install
    if route == "generate" and stack is NO_VLLM_NO_CB:
        assert "no continuous_batching: " in why and "transformers>=5.8.0" in why  # why not the paged route


def test_missing_plugin_names_the_package():
    _, why = choose_route(use_vllm=True, quantization="4bit", stack=NO_PLUGIN_CPU)
    assert "vllm-bnb-plugin" in why and "--no-deps" in why and "FP8 weights need CUDA" in why


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.is_gpu])
def test_every_gpu_preset_generates_by_a_route_that_exists_and_fits(name):
    """With the vllm extra installed no GPU preset falls back to generate() for a reason the project could avoid,
    each route fits the preset's GPU, and the YAML header quotes the planner's current route and numbers."""
    preset = PRESETS[name]
    route, _ = preset.route(stack=PINNED_STACK)
    if preset.use_vllm:
        assert route != "generate"
    assert preset.plan().peak_bytes <= preset.min_gpu_mem_gib * GIB
    assert generation_header(preset) in preset.yaml_path.read_text()  # `python -m grpo_accel.app.route_headers --write`


def test_first_gpu_point_within_ten_percent():
    """The first GPU point (issue 34/35; H200, 2026-11-26): h100_110k at 42 prompt + 128 completion tokens, G=8,
    vLLM absent on that host, so generate(): torch's peak reserved memory 6.44 GiB. The plan counted an engine that
    never started (15.1 GiB, +134%); the route that ran must be within 10%."""
    plan = PRESETS["h100_110k"].plan({"max_completion_length": 128}, NO_VLLM_NO_CB, max_prompt_length=42)
    assert plan.route == "generate"
    measured = 6.44 * GIB
    assert abs(plan.reserved_bytes - measured) / measured < 0.10, plan.format()


def test_generate_route_grows_with_the_generation_batch():
    """TRL's non-vLLM path generates per_device_train_batch_size x steps_per_generation sequences in one call: the
    ZeRO-3 presets generate one micro-batch at a time (a generation batch of 8 over 8 ranks) so the KV cache stays
    one sequence; TRL's default (8 per rank) would not fit."""
    preset = PRESETS["8xh100_zero3_offload"]
    one = preset.plan()
    eight = preset.plan({"generation_batch_size": 64})
    per_seq = (preset.max_prompt_length + preset.max_completion_length) * QWEN3_8B_KV_PER_TOKEN
    assert one.device["generate_kv_cache"] == per_seq and eight.device["generate_kv_cache"] == 8 * per_seq
    assert one.peak_bytes <= preset.min_gpu_mem_gib * GIB < eight.peak_bytes
