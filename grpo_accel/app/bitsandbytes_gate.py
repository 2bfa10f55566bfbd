"""A run that loads no 4-bit weights does not import bitsandbytes.

peft imports bitsandbytes whenever it is installed (`peft/helpers.py`: `try: import bitsandbytes`), and transformers
imports peft as soon as TRL's config class is built, before a run's spec is resolved. Importing bitsandbytes costs
~1.2 s of a core per process (`python -X importtime -c "import peft"`), and on a CPU with AVX512-BF16 its CPU backend
reaches for a hub kernel as it loads. So launch/train.py reads the one field that needs it first, with
resolve_run_spec's precedence (flags > the `--config` YAML > the preset: `--preset`, the YAML's, the launching
YAML's, the detected GPU's), and a run that does not quantize hides the package for its process:
`sys.modules["bitsandbytes"] = None` makes `import bitsandbytes` raise ImportError and `importlib.util.find_spec`
answer None, which is how peft and transformers ask. Anything the scan cannot read counts as quantizing (nothing is
hidden; resolve_run_spec then says what is wrong). `check_resolved` holds the scan to the resolved spec: a run that
quantizes with the package hidden is our bug (a traceback), caught before any weight loads.

The hiding lasts for the process: peft decides its 4-bit layer classes once, at import. So only an entry point that
is the run's own process calls `hide_unless_quantized` (launch/train.py), never a library import.
"""

from __future__ import annotations

import argparse
import sys

PACKAGE = "bitsandbytes"


def quantizes(argv: list[str]) -> bool:
    """Whether the run these flags describe loads 4-bit weights (see the module docstring)."""
    from grpo_accel.app.run_spec import split_config_flag

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--quantization")
    parser.add_argument("--preset")
    try:
        rest, config_path = split_config_flag(list(argv))
        flags, _ = parser.parse_known_args(rest)
        from_yaml = _yaml_mapping(config_path) if config_path else {}
        if flags.quantization or "quantization" in from_yaml:
            return (flags.quantization or from_yaml["quantization"]) != "none"
        from grpo_accel.app.presets import select_preset

        preset, _ = select_preset(flags.preset or from_yaml.get("preset"))
    except Exception:  # noqa: BLE001  (unreadable flags, YAML or preset: resolve_run_spec names the mistake)
        return True
    return preset.quantization != "none"


def _yaml_mapping(path: str) -> dict:
    import yaml

    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(path)
    return values


def hide_unless_quantized(argv: list[str]) -> bool:
    """Hide bitsandbytes for this process unless the run quantizes or it is imported already; True if hidden."""
    if PACKAGE in sys.modules or quantizes(argv):
        return False
    sys.modules[PACKAGE] = None
    return True


def hidden() -> bool:
    return PACKAGE in sys.modules and sys.modules[PACKAGE] is None


def check_resolved(quantization: str) -> None:
    """The scan must agree with the resolved spec; where it does not, the run stops before loading a weight."""
    if quantization != "none" and hidden():
        raise RuntimeError(f"bitsandbytes was hidden from a run that resolved to --quantization {quantization}: "
                           "bitsandbytes_gate.quantizes disagrees with resolve_run_spec")


__all__ = ["check_resolved", "hidden", "hide_unless_quantized", "quantizes"]
