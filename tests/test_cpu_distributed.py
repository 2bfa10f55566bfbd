"""Several CPU processes: gloo on loopback, DeepSpeed's shm op skipped (it spin-waits forever on a missing peer)."""

import os
import sys

import pytest

from grpo_accel._compat.cpu_distributed import prepare_cpu_processes

pytestmark = pytest.mark.skipif(not os.path.exists("/sys/class/net/lo"), reason="no loopback interface named lo")

# In a fresh interpreter: the patch is process-wide. A real TorchBackend must come up over gloo with no shm op.
BACKEND = r"""
import os
from datetime import timedelta
from grpo_accel._compat.cpu_distributed import prepare_cpu_processes
prepare_cpu_processes()
import importlib
ds_torch = importlib.import_module("deepspeed.comm.torch")
backend = ds_torch.TorchBackend("gloo", timedelta(minutes=2), "env://", rank=0, world_size=1)
assert backend.shm_comm_op is None
print("GLOO_SOCKET_IFNAME", os.environ["GLOO_SOCKET_IFNAME"])
"""


def test_one_machine_uses_loopback_unless_told(monkeypatch):
    monkeypatch.setattr("grpo_accel._compat.cpu_distributed.skip_deepspeed_shm_op", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    prepare_cpu_processes()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice wins
    prepare_cpu_processes()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_several_machines_keep_gloos_choice(monkeypatch):
    monkeypatch.setattr("grpo_accel._compat.cpu_distributed.skip_deepspeed_shm_op", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    prepare_cpu_processes()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_deepspeed_backend_comes_up_without_the_shm_op(tmp_path):
    pytest.importorskip("deepspeed")
    from support.launch import child_env, free_port, run_process_group

    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                    WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = run_process_group([sys.executable, "-c", BACKEND], 300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "GLOO_SOCKET_IFNAME lo" in proc.stdout
    assert "shared-memory all-reduce op skipped" in proc.stdout
    assert not (tmp_path / "ext").exists()  # nothing was JIT-built


@pytest.mark.parametrize("launch", ["ddp", "accelerate deepspeed", "--deepspeed flag"])
def test_plain_multi_process_runs_count_their_processes(launch, monkeypatch):
    """Several CPU processes without DeepSpeed (torch DDP: a torchrun launch, LOCAL_RANK set) run with use_cpu, the
    only way accelerate 1.15 counts them without CUDA; DeepSpeed ones keep use_cpu false (DESIGN.md). Checked through
    accelerate's own backend choice for the defaults run_spec gives."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from grpo_accel.app.run_spec import cpu_processes_defaults

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    if launch == "accelerate deepspeed":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    defaults = cpu_processes_defaults({"deepspeed": "ds.json"} if launch == "--deepspeed flag" else {})
    assert defaults["ddp_backend"] == "gloo"
    assert defaults.get("use_cpu", False) is (launch == "ddp")
    _, kind = PartialState._prepare_backend(PartialState, cpu=defaults.get("use_cpu", False), backend="gloo")
    if launch == "ddp":
        assert kind == DistributedType.MULTI_CPU
    else:  # DeepSpeed's own engine runs the processes; accelerate's plain choice would be none
        assert kind == DistributedType.NO
