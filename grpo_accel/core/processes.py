"""How many processes run this job and which one this is: one answer for every module.

Before torch.distributed starts (config checks, the run spec, the vLLM engine's start) only the launcher's environment
knows: torchrun and `accelerate launch` set WORLD_SIZE, LOCAL_WORLD_SIZE and RANK. Once a process group runs, it is
the answer. (accelerate's PartialState would start the process group to answer; these must not.)"""

from __future__ import annotations

import os


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def launched_processes() -> int:
    """Processes the launcher started for this job (WORLD_SIZE), 1 without a launcher."""
    return max(1, _env_int("WORLD_SIZE", 1))


def local_processes() -> int:
    """Processes sharing this machine's memory (LOCAL_WORLD_SIZE), 1 without a launcher."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1))


def process_rank() -> int:
    """This process's global rank as the launcher set it (RANK), 0 without a launcher."""
    return _env_int("RANK", 0)


def local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK), its global rank where the launcher sets none."""
    return _env_int("LOCAL_RANK", process_rank())


def group_size() -> int:
    """Processes in the running default process group; 1 when none runs."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def several_processes() -> bool:
    """A process group of more than one process runs: collectives are needed to keep the ranks in step."""
    return group_size() > 1
