"""Bytes one weight sync sends a `vllm serve` machine in a LoRA run (issue 52's goal: <= 1/100 of TRL's server mode):
the adapter folder AdapterSync writes against every parameter of the merged model that TRL 1.16 pushes.

    .venv/bin/python benchmarks/bench_sync_bytes.py          # ~1 min on 2 cores; writes ~2 GB of adapters to /tmp

Shapes: the embedded SmolLM2-135M (its config.json), Llama-3.1-8B and Qwen3-8B (planning/architectures.py's copies
of their published configs), each built on the meta device in fp32 and in bf16 with LoRA rank 8, 16 and 64 on every
linear projection (PEFT's "all-linear": q, k, v, o, gate, up, down; lm_head excluded), alpha 2r. Only the LoRA
parameters are made real (random values), the base stays on meta; then per row:

- adapter_sync: the files AdapterSync.write puts in the sync folder (safetensors + adapter_config.json + PEFT's
  README.md, summed from the disk as `server/sync_bytes_total` counts them), tensors in the base's dtype as the trainer
  wires it (adapter_sync.base_dtype: vLLM casts a loaded adapter to the served model's dtype, so no more is kept).
- adapter_sync_fp32_files: the same with dtype=None, PEFT's fp32 adapter as written before c37f6ff (bf16 rows only;
  an fp32 base's files are these).
- trl_server: what TRL 1.16's server mode sends each sync, counted the way it sends it: VLLMGeneration.sync_weights
  (trl/generation/vllm_generation.py:496-505) streams _iter_named_params (:435-470: merge_adapter, then every
  model.named_parameters() entry except the LoRA ones (`model.prefix in name`) and `original_module`, tied weights
  once) through VLLMClient.update_named_params (trl/generation/vllm_client.py:821-859, an NCCL broadcast of each
  tensor as it is, in the base's dtype: the merge writes into the base weights). Bytes = numel x element size of
  those parameters of the same PEFT model.

Writes benchmarks/results/sync_bytes.csv (long format: bytes_per_sync, params, and fraction_of_trl_server per
adapter row) and sync_bytes.png.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import harness  # benchmarks/ is on sys.path when run as a script
import torch

MODELS = ("smollm2-135m", "llama-3.1-8b", "qwen3-8b")
RANKS = (8, 16, 64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GOAL = 1 / 100  # issue 52


def model_config(name: str):
    if name == "smollm2-135m":
        from transformers import AutoConfig

        from grpo_accel.data.models import embedded_model_dir

        return AutoConfig.from_pretrained(embedded_model_dir())
    from grpo_accel.planning.architectures import get_architecture

    return get_architecture(name)


def lora_on_meta(config, dtype: torch.dtype, rank: int):
    """The PEFT model of `config` in `dtype` on the meta device, its LoRA parameters real (fp32 as PEFT keeps them,
    random) and the base's not."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.lora_A.to_empty(device="cpu")
            module.lora_B.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.prefix in name:
                p.normal_(std=0.02)
    return model


def trl_server_bytes(model) -> tuple[int, int]:
    """(parameters, bytes) TRL 1.16's server mode streams per sync: _iter_named_params' filter (module docstring)."""
    params = nbytes = 0
    for name, p in model.named_parameters():
        if model.prefix in name or "original_module" in name:
            continue
        params += p.numel()
        nbytes += p.numel() * p.element_size()
    return params, nbytes


def measure(name: str, label: str, rank: int, tmp: Path) -> list[dict]:
    from grpo_accel.generation.adapter_sync import AdapterSync, base_dtype

    model = lora_on_meta(model_config(name), DTYPES[label], rank)
    assert base_dtype(model) == DTYPES[label]
    shape = f"{name},{label},lora-r{rank},all-linear"
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if model.prefix in n)
    trl_params, trl_bytes = trl_server_bytes(model)
    rows = [dict(op="sync_bytes", impl="trl_server", shape=shape, metric="bytes_per_sync", value=trl_bytes,
                 unit="bytes"),
            dict(op="sync_bytes", impl="trl_server", shape=shape, metric="params", value=trl_params, unit="count")]
    variants = {"adapter_sync": base_dtype(model)}
    if DTYPES[label] != torch.float32:
        variants["adapter_sync_fp32_files"] = None
    for impl, dtype in variants.items():
        sync = AdapterSync("http://unused", tmp / f"{shape}-{impl}", dtype=dtype)
        folder = sync.write(model, 1)
        shutil.rmtree(folder)
        rows += [dict(op="sync_bytes", impl=impl, shape=shape, metric="bytes_per_sync", value=sync.bytes_sent,
                      unit="bytes"),
                 dict(op="sync_bytes", impl=impl, shape=shape, metric="params", value=adapter_params, unit="count"),
                 dict(op="sync_bytes", impl=impl, shape=shape, metric="fraction_of_trl_server",
                      value=f"{sync.bytes_sent / trl_bytes:.5g}", unit="ratio")]
        met = "met" if sync.bytes_sent <= GOAL * trl_bytes else "NOT met"
        print(f"{shape:40s} {impl:24s} {sync.bytes_sent / 1e6:9.1f} MB vs TRL {trl_bytes / 1e9:6.2f} GB: "
              f"1/{trl_bytes / sync.bytes_sent:.0f}  goal 1/100 {met}", flush=True)
    return rows


FILES = {("fp32", "adapter_sync"): "fp32 base: fp32 files", ("bf16", "adapter_sync_fp32_files"):
         "bf16 base: fp32 files (before c37f6ff)", ("bf16", "adapter_sync"): "bf16 base: bf16 files (base dtype)"}


def plot(rows: list[dict], png: Path) -> None:
    """Per model and rank (shape: model, base dtype, rank, ...), each kind of files' fraction of TRL's bytes."""
    metric = "fraction_of_trl_server"
    harness.grouped_bars(rows, png, [(metric, "bytes per sync / TRL server mode's (dashed: issue 52's goal, 1/100)")],
                         order=list(FILES.values()), log=(metric,), goal=GOAL, fmt=None,
                         group=lambda r: "\n".join(r["shape"].split(",")[0:3:2]),
                         series=lambda r: FILES[r["shape"].split(",")[1], r["impl"]],
                         title="adapter-only sync vs TRL 1.16 server mode (merged model over NCCL), LoRA on every "
                               "linear projection")


def main(argv=None) -> int:
    p = harness.parser(__doc__, "sync_bytes.csv")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=list(RANKS))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sync_bytes_") as tmp:
        for name in args.models:
            for rank in args.ranks:
                for label in DTYPES:
                    rows += measure(name, label, rank, Path(tmp))
    harness.write_results(rows, args.out, harness.run_meta("cpu", ("torch", "transformers", "peft", "trl")), plot)
    return 0


if __name__ == "__main__":
    harness.run(main)
