"""The fused head's GEMMs at vocab-tile widths 43690 (no 16-byte multiple), 43648 and 32768 (CUDA, bf16, N=H=4096).

    python benchmarks/gemm_alignment.py      # prints one line per (width, GEMM form); CUDA only

Why `grpo_accel.ops.logprobs` rounds a widened tile to a multiple of 128 columns: the tile width is the leading
dimension of the logits block and of its transpose in the d(weight) GEMM. The H100 run (torch 2.11+cu130, 2026-11-23)
is `benchmarks/results/gemm_alignment_h100.txt`: 250-290 TFLOP/s at 43690, 690-780 at 43648.
Time = mean of 10 calls after one warm-up (CUDA events).
"""

import torch

torch.manual_seed(0)
N, H = 4096, 4096
h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)


def t(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


for W in (43690, 43648, 32768):
    w = torch.randn(W, H, device="cuda", dtype=torch.bfloat16)
    a = torch.empty(N, W, device="cuda", dtype=torch.float32)
    d = torch.randn(N, W, device="cuda", dtype=torch.bfloat16)
    gw = torch.zeros(W, H, device="cuda", dtype=torch.float32)
    gh = torch.zeros(N, H, device="cuda", dtype=torch.float32)
    fl = 2 * N * H * W / 1e12
    r = {  # the five GEMM forms of the fused head
        "logits addmm out_dtype fp32": t(lambda: torch.addmm(a, h, w.T, out_dtype=torch.float32, out=a)),
        "logits mm bf16": t(lambda: torch.mm(h, w.T)),
        "d_hidden addmm fp32": t(lambda: torch.addmm(gh, d, w, out_dtype=torch.float32, out=gh)),
        "d_weight addmm fp32 (d.T @ h)": t(lambda: torch.addmm(gw, d.T, h, out_dtype=torch.float32, out=gw)),
        "d_weight mm bf16 (d.T @ h)": t(lambda: torch.mm(d.T, h)),
    }
    for k, ms in r.items():
        print(f"W={W:6d} {k:32s} {ms:8.3f} ms  {fl/ms*1e3:6.0f} TFLOP/s")
