"""Worker for tests/test_offload_tiled.py: one checkpointed, offloaded backward of SmolLM2-135M-shaped layers (random
init, no LM head: the head's [T, V] logits would swamp the layers) over one row of T tokens; prints one JSON line
with the backward's peak of autograd-saved bytes (tracker) and its peak RSS above the RSS at backward start.
Run it with MALLOC_MMAP_THRESHOLD_ fixed (glibc's dynamic threshold keeps freed blocks in the heap, so the RSS peak
would follow the allocator's history, not the live tensors).

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python tests/workers/tiled_memory_worker.py --tokens 8192 \
        --layers 2 --recompute-tokens 1024
"""

import argparse
import json
import time

import torch
import transformers

from grpo_accel.core.phase_memory import proc_status_bytes, reset_peak_rss
from grpo_accel.offload import OffloadConfig, SavedActivationTracker, install_activation_offload
from grpo_accel.planning.architectures import get_architecture

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--recompute-tokens", type=int, default=0, help="0: whole re-run")
a = p.parse_args()

torch.manual_seed(0)
cfg = get_architecture("smollm2-135m")
cfg.num_hidden_layers, cfg.use_cache = a.layers, False
cfg._attn_implementation = "sdpa"
model = transformers.LlamaModel(cfg).train()
install_activation_offload(model, OffloadConfig(device_copies=True, use_streams=False, pin_memory=False, min_bytes=0,
                                                recompute_tokens=a.recompute_tokens or None))
x = torch.randn(1, a.tokens, cfg.hidden_size, requires_grad=True)
w = torch.randn(1, a.tokens, cfg.hidden_size)
with SavedActivationTracker(observe_autograd=True, ignore=model.parameters()) as tracker:
    t0 = time.perf_counter()
    hidden = model(inputs_embeds=x).last_hidden_state
    loss = (hidden * w).sum()
    del hidden
    forward_s = time.perf_counter() - t0
    tracker.reset_peak()
    assert reset_peak_rss(), "needs /proc/self/clear_refs"
    start = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    loss.backward()
    backward_s = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM")
grad_norm = sum(p.grad.double().norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
print("RESULT " + json.dumps(dict(saved_peak_bytes=tracker.peak["device"], rss_peak_bytes=peak - start,
                                  forward_s=forward_s, backward_s=backward_s, loss=loss.item(),
                                  grad_norm=float(grad_norm), x_grad_norm=float(x.grad.norm()))))
