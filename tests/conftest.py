import pytest
import torch


def pytest_report_header(config):
    """The CPU kernels and threads this run rounds with: a tolerance failure on one machine is reproduced with them
    (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS; tests/portability.py runs the others)."""
    return f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, " \
           f"{torch.get_num_threads()} threads"


# The slowest files of the multi-process + long tier, slowest first (--durations, 2026-11-29): pytest-xdist hands a
# worker the next whole file (--dist loadfile) in collection order (with --no-loadscope-reorder; by default, in order
# of their number of tests), so a 7-minute file handed out last would run alone at the end while the other core
# idles. Longest first keeps both cores busy to the end.
# The vLLM tiers' files after them (their tiers never run with the others).
SLOWEST_FIRST = ("test_gpu_campaign.py", "test_moe_distributed.py", "test_sequence_parallel.py",
                 "test_distributed.py", "test_continuous_batching.py", "test_server_distributed.py",
                 "test_preemption.py", "test_qlora_multiprocess.py", "test_offload_multiprocess.py", "test_soak.py",
                 "test_vllm_trainer.py", "test_engine_rows.py", "test_vllm_qlora.py", "test_vllm_launch.py",
                 "test_vllm_server.py", "test_vllm_truncated.py", "test_vllm_resume.py", "test_vllm_moe.py",
                 "test_vllm_colocate.py")


def pytest_collection_modifyitems(config, items):
    """The slowest files first (above); GPU tests exist everywhere and skip cleanly where there is no CUDA device."""
    if getattr(config.option, "dist", None) == "loadfile":  # make test's --dist load hands out tests, not files
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept
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
