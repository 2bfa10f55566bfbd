"""No-vLLM fallback and version gate: run in both venvs (no engine needed)."""

import subprocess
import sys

import pytest

from grpo_accel.generation import vllm_availability as va


def test_fallback_line_when_vllm_missing():
    # A fresh interpreter where `import vllm` fails, as in the main venv (which has no vllm at all).
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from grpo_accel.generation.vllm_availability import use_vllm_or_fallback, vllm_unavailable_reason\n"
            "assert vllm_unavailable_reason() is not None\n"
            "print('use_vllm ->', use_vllm_or_fallback(True))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines == [va.FALLBACK_LINE, "use_vllm -> False"]


def test_use_vllm_false_says_nothing(capsys):
    assert va.use_vllm_or_fallback(False) is False
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("version", ["0.25.2", "0.27.0", "0.31.2", "0.33.0", "0.10.1", "1.0.0"])
def test_unsupported_version_names_the_lines(version):
    with pytest.raises(va.VLLMVersionError, match=r"vLLM 0\.26\.x with torch 2\.11 .*vLLM 0\.32\.x with torch 2\.13"):
        va.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cpu", "0.32.0", "0.32.1", "0.32.0+cpu", "0.32.1rc1"])
def test_supported_versions_pass(version):
    assert va.check_vllm_version(version) == version


def test_launch_without_vllm_falls_back_with_one_line(tmp_path):
    """--use_vllm true where vLLM is not installed (the main venv): one line, then training with transformers'
    continuous batching (route continuous_batching, issue 45: the next route after vLLM's)."""
    if va.vllm_unavailable_reason() is None:
        pytest.skip("vllm is installed here: the fallback cannot happen")
    from support.launch import TINY_ARGS, run_train

    proc = run_train([*TINY_ARGS, "--use_vllm", "true", "--report_to", "none", "--output_dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    route_lines = [line for line in proc.stdout.splitlines() if "generation route" in line]
    assert len(route_lines) == 1 and "generation route continuous_batching: transformers' continuous batching" \
        in route_lines[0], route_lines
    assert "vLLM is not installed. Fix: pip install 'grpo_accel[vllm]'" in route_lines[0], proc.stdout[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()


def test_qlora_route_with_the_installed_vllm(tmp_path):
    """QLoRA x vLLM: the route the installed vLLM gives a 4-bit model, checked against vLLM's own method list after
    its plugins load. In the vLLM venvs (vLLM 0.26 in its tree; 0.32 with vllm-bnb-plugin, installed by the Makefile)
    bitsandbytes is listed and the route is the engine's own 4-bit copy; a vLLM without it takes FP8 on CUDA, else
    generate() naming the fix."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins

    from grpo_accel.generation import vllm_setup as vs
    from grpo_accel.trainer.config import GRPOAccelConfig

    load_general_plugins()
    four_bit = torch.nn.Linear(2, 2)
    four_bit.is_loaded_in_4bit = True
    args = GRPOAccelConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=40, use_vllm=True)
    action, route = vs.colocated_route(four_bit, args)
    if "bitsandbytes" in QUANTIZATION_METHODS:
        assert (action, route) == ("from_model", "vllm_4bit")
    elif torch.cuda.is_available():
        assert (action, route) == ("from_model", "vllm_fp8")
    else:
        assert action == "fallback" and "Fix: pip install" in route
    assert vs.colocated_route(torch.nn.Linear(2, 2), args)[1] == "vllm_shared"  # unquantized: the shared engine


def test_vllm_tier_has_the_4bit_engine():
    """Each vLLM tier's venv has the 4-bit engine: vLLM 0.26 lists bitsandbytes in its tree, 0.32 once vllm-bnb-plugin
    is loaded (the Makefile installs it with --no-deps), so the QLoRA presets' route vllm_4bit exists there."""
    pytest.importorskip("vllm")
    from grpo_accel.generation.vllm_setup import local_stack

    stack = local_stack()
    assert stack.vllm and stack.bnb_4bit, stack.missing
