"""The numerically sensitive tests under every CPU kernel level this machine offers and 1 or 2 threads: a test whose
tolerance was fitted to one CPU's kernels fails here, not on a user's machine (issue 46: two such tests passed on
the AMD host CI ran on and failed on an AVX-512 Xeon).

    make test-portability        # or: python tests/portability.py [--levels default,avx2] [--threads 1]

A level stands for an older CPU in the three libraries that pick kernels by instruction set: ATen's own kernels
(ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA: bf16 / fp16 matmuls, convolutions) and MKL's (fp32 GEMM,
MKL_ENABLE_INSTRUCTIONS); each changes rounding (an fp16 LoRA gradient's distance to plain half training moves
0.32x -> 0.20x of its error between ATen-only AVX2 and all-three AVX2). `native` is the machine as it is. Levels
above the CPU's own are not offered (ATen would fall back to the highest it has, testing nothing new).
Threads: reductions split by thread, so 1 and 2 threads round differently. The cell `make test` already runs
(native, one thread per worker: TEST_THREADS in the Makefile) is left out.

What runs: TRL parity, the fused head's kernels, offload, sequence tiles, tiled MLP, packing, shared prompt, MoE and
the patches test (FILES below), minus a launch/train.py run (its subprocess always gets one thread,
support.launch.child_env) and a ZeRO-3 hooks test, a quarter of the time between them. Cells: every level at 1
thread, the lowest level at 2 too (`--every`: the whole cross product).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["tests/test_trainer_parity.py", "tests/test_logprobs.py", "tests/test_offload.py",
         "tests/test_offload_tiled.py", "tests/test_offload_residency.py", "tests/test_tiled_mlp.py",
         "tests/test_packing.py", "tests/test_shared_prompt.py", "tests/test_moe.py", "tests/test_patches.py"]
DESELECT = ["tests/test_packing.py::test_launch_padding_free_true_and_false_log_the_same_loss",  # a whole run
            "tests/test_offload.py::test_zero3_param_hooks_fire_in_the_recompute"]  # hooks firing, not rounding
ORDER = ["default", "avx2", "avx512"]  # ATen's capabilities on x86, lowest first
LEVELS = {  # level -> the environment that caps every kernel library at it
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "native": {},
}
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def probe(env: dict) -> tuple[str, int]:
    """What ATen runs under `env` ('DEFAULT', 'AVX2', 'AVX512', ...) and torch's thread count, in a fresh process."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cap, threads = out.stdout.split()
    return cap, int(threads)


# Instruction-set extensions above a level's cap that oneDNN or MKL use when the CPU has them (bf16/int8 matmuls):
# on a CPU with none of them, capping at the CPU's own top level changes no kernel, and that cell is `native` again.
ABOVE = {"avx2": ("avx512f", "avx_vnni", "amx_bf16", "amx_tile"),
         "avx512": ("avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def offered_levels(native: str, flags: set[str] | None = None) -> list[str]:
    """The levels at or below this CPU's own, then `native`; the CPU's own level is left out where it is `native`
    exactly (no extension above its cap: an AVX2-only EPYC's avx2 cell ran the same kernels as its native one, ~2 min
    of CI for nothing). Flags unknown (no /proc/cpuinfo): every level is kept."""
    top = next((i for i, name in enumerate(ORDER) if native.lower().startswith(name)), 0)
    levels = ORDER[:top + 1]
    flags = cpu_flags() if flags is None else flags
    if top > 0 and flags and not any(f in flags for f in ABOVE.get(levels[-1], ())):
        levels = levels[:-1]
    return levels + ["native"]


def make_test_threads() -> int:
    """The thread count make test's workers run at (the Makefile exports TEST_THREADS; 1 by default)."""
    return int(os.environ.get("TEST_THREADS", "1"))


def cells(levels: list[str], threads: list[int], make_test: int, every: bool) -> list[tuple[str, int]]:
    """Every level at the first thread count; the others at the lowest level only (unless `every`): the thread
    count moves reduction splits, the level kernels, and CI's hour holds ~5 cells. The cell make test runs (native at
    `make_test` threads) is left out."""
    todo = [(lv, t) for t in threads for lv in levels if every or t == threads[0] or lv == levels[0]]
    return [(lv, t) for lv, t in todo if not (lv == "native" and t == make_test)]


def run_cell(level: str, threads: int, base_env: dict, extra: list[str]) -> tuple[int, float, str]:
    env = {k: v for k, v in base_env.items() if k not in CAPS}
    env.update(LEVELS[level], OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    got = probe(env)[0]
    # one thread per process: two xdist workers use both cores; two threads: one process, else 4 threads on 2 cores
    workers = ["-n", "2", "--dist", "load"] if threads == 1 else ["-p", "no:xdist"]
    tier = "not gpu and not vllm and not distributed and not long"
    cmd = [sys.executable, "-m", "pytest", "-q", *workers, "-m", tier, "--timeout", "900",
           *[f"--deselect={d}" for d in DESELECT], *FILES, *extra]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    print(f"{level:8s} threads={threads} ATen={got:8s} {time.time() - start:6.0f} s  {tail}", flush=True)
    if proc.returncode:
        print(proc.stdout[-6000:], flush=True)
        repro = " ".join(f"{k}={v}" for k, v in {**LEVELS[level], "OMP_NUM_THREADS": threads}.items())
        print(f"reproduce: {repro} {sys.executable} -m pytest -q {' '.join(FILES)}", flush=True)
    return proc.returncode, time.time() - start, tail


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", help="comma-separated subset of default,avx2,avx512,native (default: all offered)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--every", action="store_true", help="every level at every thread count (7 cells on an AVX-512 CPU)")
    args, extra = p.parse_known_args(argv)
    base_env = dict(os.environ)
    native, _ = probe({k: v for k, v in base_env.items() if k not in CAPS + ("OMP_NUM_THREADS",)})
    offered = offered_levels(native)
    levels = args.levels.split(",") if args.levels else offered
    unknown = [lv for lv in levels if lv not in offered]
    if unknown:
        print(f"error: level(s) {unknown} not offered by this CPU (it offers {offered})", file=sys.stderr)
        return 2
    make_test = make_test_threads()
    todo = cells(levels, [int(t) for t in args.threads.split(",")], make_test, args.every)
    print(f"portability: {len(todo)} cells, levels {levels} x threads {args.threads} (this CPU: {native}; "
          f"native x {make_test} thread(s) is make test's own), {len(FILES)} files", flush=True)
    failed = [(lv, t) for lv, t in todo if run_cell(lv, t, base_env, extra)[0]]
    if failed:
        print(f"FAILED under {failed}: a tolerance fitted to one CPU, or a real portability bug", flush=True)
        return 1
    print("portability: every cell passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
