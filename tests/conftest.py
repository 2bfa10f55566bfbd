import pytest
import torch


def pytest_report_header(config):
    """The CPU kernels and threads this run rounds with: a tolerance failure on one machine is reproduced with them
    (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS; tests/portability.py runs the others)."""
    return f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, " \
           f"{torch.get_num_threads()} threads"


def pytest_collection_modifyitems(config, items):
    """GPU tests exist everywhere and skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
