"""The scan that decides, before the stack is imported, whether a run may hide bitsandbytes must agree with
resolve_run_spec on every preset, with --quantization, --preset and a --config YAML in each precedence."""

import subprocess
import sys

import pytest

from grpo_accel.app import bitsandbytes_gate
from grpo_accel.app.presets.table import PRESETS
from grpo_accel.app.run_spec import resolve_run_spec


def _resolved_quantizes(argv):
    return resolve_run_spec(argv, for_plan=True).script.quantization != "none"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_scan_agrees_with_the_resolved_spec_on_every_preset(name, tmp_path):
    cases = [["--preset", name]]
    flip = "none" if PRESETS[name].quantization != "none" else "4bit"
    if flip == "none" or PRESETS[name].lora_r:  # 4-bit needs LoRA: a full fine-tuning preset refuses it
        cases.append(["--preset", name, "--quantization", flip])
        cases.append(["--preset", name, f"--quantization={flip}"])
        yaml = tmp_path / "run.yaml"
        yaml.write_text(f"preset: {name}\nquantization: {flip}\n")
        cases.append(["--config", str(yaml)])
        cases.append(["--config", str(yaml), "--quantization", PRESETS[name].quantization])  # the flag wins
    for argv in cases:
        assert bitsandbytes_gate.quantizes(argv) == _resolved_quantizes(argv), argv


def test_the_detected_preset_decides_without_flags():
    assert bitsandbytes_gate.quantizes([]) == _resolved_quantizes([])


def test_what_the_scan_cannot_read_counts_as_quantizing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantization: [unclosed\n")
    for argv in (["--preset", "no_such_preset"], ["--config", str(bad)], ["--config", str(tmp_path / "none.yaml")]):
        assert bitsandbytes_gate.quantizes(argv)


def test_hidden_bitsandbytes_is_invisible_to_peft_and_a_quantizing_spec_stops():
    """In a fresh process: hidden, peft's own availability check says no and its import does not load the package;
    a spec that resolves to 4-bit with it hidden is our bug and stops before any weight loads."""
    code = """
import sys
from grpo_accel.app import bitsandbytes_gate
assert bitsandbytes_gate.hide_unless_quantized(["--preset", "cpu"])
import peft
from peft.import_utils import is_bnb_available
assert not is_bnb_available() and sys.modules["bitsandbytes"] is None
bitsandbytes_gate.check_resolved("none")
try:
    bitsandbytes_gate.check_resolved("4bit")
except RuntimeError as exc:
    print("stopped:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stopped: bitsandbytes was hidden" in out.stdout
