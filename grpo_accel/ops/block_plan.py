"""How big the fused head's logit blocks are: rows x vocab columns per block, from a memory budget.

No torch here: the memory planner imports this (`grpo-accel presets` / `plan` must not pay torch's ~2.5 s import on
2 cores for three integer formulas); `ops.logprobs` re-exports it beside the kernels that use it.
"""

from __future__ import annotations

_MIB = 1 << 20
# CPU: blocks that fit the last-level cache make the elementwise passes 2-6x faster per element than blocks
# streamed from DRAM (32 MiB-L3 EPYC, 1 thread: `sub_` 0.4 ms on 4M fp32 vs 3.3 ms on 16M; a row dot 2.1 vs
# 48.6 ms); the GEMMs keep ~85 GF/s down to [512, 2048] blocks. At H=576 the GEMMs are ~90% of the time anyway.
CPU_BUDGET_BYTES = 32 * _MIB
# CUDA: bigger blocks mean fewer kernel launches (~15 per block); 1/16 of free memory leaves the rest to the model.
CUDA_BUDGET_MAX_BYTES = 1024 * _MIB
_DEFAULT_VOCAB_TILE = {"cpu": 4096, "cuda": 16384}
# A widened tile is a multiple of 128 columns: the tile width is the leading dimension of the block and of its
# transpose in the d(weight) GEMM, and cuBLAS leaves its tensor-core kernels for leading dimensions that are not
# 16-byte multiples. H100, bf16, N=H=4096: 250-290 TFLOP/s at width 43690, 690-780 at 43648
# (benchmarks/gemm_alignment.py); the head's fwd+bwd at V=128256 went from 71 ms to 27 ms (TRL 1.16: 26 ms).
_TILE_ALIGN = 128


def live_blocks(softcap, compute_entropy):
    """fp32 [chunk, tile] blocks the torch folds hold at once (worst case: backward with softcap + entropy grad)."""
    return 1 + bool(compute_entropy) + (softcap is not None)


def planned_budget_bytes(device_type: str) -> int:
    """The budget the memory planner assumes: the CUDA cap (>= 16 GiB free when the head runs), or the CPU one."""
    return CUDA_BUDGET_MAX_BYTES if device_type == "cuda" else CPU_BUDGET_BYTES


def plan_blocks_for_budget(n_rows, vocab, device_type, budget, bytes_per_elem, chunk_size=None, vocab_tile=None):
    """plan_blocks for a given budget (no device query): what the memory planner imports."""
    n_rows = max(int(n_rows), 1)
    tile = min(vocab, vocab_tile or _DEFAULT_VOCAB_TILE.get(device_type, 8192))
    chunk = chunk_size or max(16, budget // (tile * bytes_per_elem) // 16 * 16)
    if chunk >= n_rows:
        chunk = n_rows
        if vocab_tile is None:
            tile = min(vocab, max(tile, budget // (n_rows * bytes_per_elem) // _TILE_ALIGN * _TILE_ALIGN))
    return int(chunk), int(tile)
