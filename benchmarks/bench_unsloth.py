"""One GRPO training step of Unsloth's GRPOTrainer with fixed completions: the peer's figures beside ours (issue 44).

    # here (CPU): which Unsloth / transformers / TRL would run, and whether `import unsloth` works (one line)
    UNSLOTH_SITE=/tmp/unsloth_site python benchmarks/bench_unsloth.py --preflight
    # on a GPU loan, after benchmarks/campaign/unsloth_wheels.sh here and its install line there (docs/unsloth.md):
    # a. the seeds' shape, Llama-3.1-8B LoRA bf16, 512 + 19,968 tokens, G=8
    python benchmarks/bench_unsloth.py --arch llama-3.1-8b --num-generations 8 --prompt-length 512 \
        --completion-length 19968 --reps 1
    # b. Qwen3-8B QLoRA, 64 + 32,768 tokens
    python benchmarks/bench_unsloth.py --arch qwen3-8b --quant 4bit --num-generations 8 --completion-length 32768 \
        --reps 1
    # c. the longest completion that fits: 64K, 96K, 128K, ... one process per probe, stop at the first that fails
    python benchmarks/bench_unsloth.py --arch qwen3-8b --quant 4bit --num-generations 8 --find-max-t \
        --completion-length 65536 --t-step 32768 --max-t 262144 --reps 0

Each step runs in its own worker process whose sys.path starts with UNSLOTH_SITE (unsloth 2026.10.9, unsloth_zoo,
trl 1.15.0, datasets 4.x: benchmarks/campaign/unsloth_wheels.sh); this parent and our rows keep trl 1.16. The worker
uses Unsloth as its docs tell a GRPO user to: `import unsloth` first, FastLanguageModel.from_pretrained (load_in_4bit
for QLoRA, fast_inference=False: no vLLM), FastLanguageModel.get_peft_model (r=16, alpha 32, dropout 0 on q,k,v,o,gate,
up,down: our rows' adapter) with use_gradient_checkpointing="unsloth", then trl's GRPOConfig / GRPOTrainer, which
`import unsloth` replaced by its own (the worker refuses to measure if they are still TRL's).

The step is bench_step_memory.py's: its fixed batch (make_inputs: the same random prompt and completion ids, lengths
spread T/2..T, right-padded, the same advantages and old log-probs), then `trainer.compute_loss(model, inputs)` (here
Unsloth's: sequence packing, its chunked hidden-state log-softmax, row mini-batches sized from free memory) and
`backward()`; no generation, no optimizer step, as in our rows. Only the padding differs: Unsloth finds padding by
the pad id (ours by the mask), so padded positions carry the tokenizer's pad id. Same GRPOConfig values as our rows
(TRL 1.16's defaults: lr 1e-6, adamw_torch_fused, loss dapo, beta 0); one micro-batch of G rows, as Unsloth sets it.
The random checkpoint is random_models.save_random_model's, shared with bench_step_memory's 4-bit rows (--ckpt-cache).

CSV rows (long format, merged into --out, default benchmarks/results/step_memory.csv beside ours): op
grpo_step_fwd_bwd, impl unsloth, shape exactly as bench_step_memory writes it (its _shape), metrics oom,
peak_allocated_with_weights_mib (= bench_step_memory's peak_step_mem_with_weights_mib, written under both names),
peak_reserved_with_weights_mib, step_time_ms, time_per_token_us, loss, lora_grad_norm, ...; `versions` holds what the
worker imports (unsloth, unsloth_zoo, transformers, trl, torch). --find-max-t adds op grpo_max_completion_length
(max_completion_length, probes, first_failed_t). An OOM is a row (oom=1), not a crash.
Exit codes: 0 done; 2 no CUDA GPU or no Unsloth site (one `error:` line); --preflight: 0 imports on its GPU path,
3 does not (the line says why).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata as md
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_step_memory as bsm  # benchmarks/ is on sys.path when run as a script: the shapes the judge pairs
import harness
from harness import MIB, RESULTS, ROOT

PREFLIGHT_TAG = "preflight:"
EXIT_NO_GPU, EXIT_PREFLIGHT_FAILS = 2, 3
IMPL = "unsloth"
# our rows' adapter (bench_step_memory: "all-linear" = these seven in a Llama / Qwen3 decoder)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
# what bench_step_memory's rows get from TRL 1.16's GRPOConfig defaults; pinned because Unsloth's config has other
# defaults (tests/test_bench_unsloth.py fails when TRL's move)
TRAINING = dict(learning_rate=1e-6, optim="adamw_torch_fused", loss_type="dapo", beta=0.0, temperature=1.0,
                epsilon=0.2)
# the worker's view of the stack: the versions column and the preflight line
VERSIONED = ("unsloth", "unsloth_zoo", "transformers", "trl", "torch", "peft", "bitsandbytes", "datasets")
# Unsloth's import-time settings: no CPU fallback (its CPU backend is stock transformers + TRL: not what we compare
# with), no hub or statistics calls (the GPU hosts are offline), its generated trainer code outside the tree
WORKER_ENV = dict(UNSLOTH_DISABLE_CPU_FALLBACK="1", UNSLOTH_DISABLE_STATISTICS="1", HF_HUB_OFFLINE="1",
                  TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
NO_GPU = ("error: bench_unsloth.py needs a CUDA GPU (Unsloth's GRPO runs on its GPU path only): run it on a GPU "
          "loan (docs/unsloth.md); here, --preflight says what would run")
NO_SITE = ("error: no Unsloth site (UNSLOTH_SITE={site!r} holds no unsloth): run "
           "benchmarks/campaign/unsloth_wheels.sh here, carry .whl-unsloth, then on the host `pip install --no-index "
           "--no-deps --target /tmp/unsloth_site .whl-unsloth/*.whl` and export UNSLOTH_SITE=/tmp/unsloth_site")


# ------------------------------------------------------------------------------------------------ both sides
def site_has_unsloth(site) -> bool:
    return bool(site) and (Path(site) / "unsloth" / "__init__.py").is_file()


def site_versions(site, names=VERSIONED) -> dict[str, str]:
    """Which version of each package a process whose sys.path starts with `site` imports: the first dist-info on
    that path, read without importing anything (so the parent can say what the worker will run)."""
    found = {}
    for entry in [str(site), *sys.path] if site else sys.path:
        for dist in md.distributions(path=[entry]):
            name = (dist.metadata["Name"] or "").lower().replace("-", "_")
            if name in names and name not in found:
                found[name] = dist.version
    return {n: found[n] for n in names if n in found}


def versions_field(versions: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in versions.items())


def pin_problems(site, versions: dict) -> list[str]:
    """The versions here that Unsloth's own requirements exclude (transformers <= 5.17.0, trl <= 1.15.0, torch <
    2.15): `pip install --no-deps` never checks them, so the preflight does."""
    from packaging.requirements import Requirement

    try:
        dist = next(md.distributions(name="unsloth", path=[str(site)]))
    except StopIteration:
        return []
    problems = []
    for line in dist.requires or []:
        req = Requirement(line)
        name = req.name.lower().replace("-", "_")
        if name in ("transformers", "trl", "torch") and name in versions and not req.marker:
            if not req.specifier.contains(versions[name].split("+")[0], prereleases=True):
                problems.append(f"{name} {versions[name]} outside unsloth's {req.specifier}")
    return problems


def shape(args, T=None) -> str:
    """bench_step_memory's shape string for the same sizes (bf16 on CUDA): rows pair with ours_mb1 and trl_tuned."""
    ns = argparse.Namespace(arch=args.arch, quant=args.quant, num_generations=args.num_generations,
                            prompt_length=args.prompt_length, device="cuda", equal_lengths=args.equal_lengths,
                            t_step=args.t_step, preset=None)
    return bsm._shape(ns, T)


def fixed_batch(G, P, T, V, pad_id, device="cpu", equal=False):
    """bench_step_memory.make_inputs' batch with Unsloth's padding convention: it finds padding by the pad id
    (left-packs prompts, rebuilds the completion mask and packs rows by `ids != pad`), ours by the mask. So padded
    completion positions get `pad_id`, and a random real token that happens to equal it becomes 3 (a plain byte)."""
    import torch

    inputs = bsm.make_inputs(G, P, T, V, "cpu", equal)
    for key, mask_key in (("prompt_ids", "prompt_mask"), ("completion_ids", "completion_mask")):
        ids, real = inputs[key], inputs[mask_key].bool()
        ids = torch.where(real & (ids == pad_id), torch.full_like(ids, 3), ids)
        inputs[key] = torch.where(real, ids, torch.full_like(ids, pad_id))
    return {k: v.to(device) for k, v in inputs.items()}


def probe_lengths(start: int, step: int, max_t: int) -> list[int]:
    """--find-max-t's completion lengths: start, start + step, ... up to max_t (64K, 96K, 128K, ...)."""
    return list(range(start, max_t + 1, step))


# ------------------------------------------------------------------------------------------------ worker side
def _site_first(site):
    """The site before everything (trl 1.15 shadows the host's 1.16); the project root last, for grpo_accel.core."""
    sys.path.insert(0, str(site))
    sys.path.append(str(ROOT))


def worker_preflight(a) -> int:
    """Import Unsloth as a run would and print one line: 0 when it loads its GPU path and patches TRL, else 3."""
    _site_first(a.site)
    try:
        import unsloth  # noqa: F401  (first, as Unsloth asks: it patches transformers, PEFT and TRL on import)
        from trl import GRPOTrainer
    except Exception as exc:  # Unsloth refuses without a GPU: NotImplementedError("... You need a GPU.")
        print(f"{PREFLIGHT_TAG} import unsloth fails here: {type(exc).__name__}: {_first_line(exc)}", flush=True)
        return EXIT_PREFLIGHT_FAILS
    if not GRPOTrainer.__name__.startswith("Unsloth"):
        print(f"{PREFLIGHT_TAG} import unsloth works but trl.GRPOTrainer is still TRL's {GRPOTrainer.__module__}",
              flush=True)
        return EXIT_PREFLIGHT_FAILS
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"{PREFLIGHT_TAG} import unsloth works ({gpu}), GRPOTrainer is {GRPOTrainer.__name__}", flush=True)
    return 0


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:240]


def build(a, tmp):
    """Model, adapter and trainer as an Unsloth GRPO user builds them (module docstring)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer  # Unsloth's, after `import unsloth`
    from unsloth import FastLanguageModel

    G, T = a.num_generations, a.completion_length
    # fix_tokenizer off: the checkpoint's tokenizer is random_models' byte-level one, not the model's; Unsloth's
    # fixes are for the real tokenizers and can reach for the hub. It touches no weight the step uses.
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(a.checkpoint), max_seq_length=a.prompt_length + T, dtype=torch.bfloat16,
        load_in_4bit=a.quant == "4bit", fast_inference=False, fix_tokenizer=False)
    torch.manual_seed(0)
    model = FastLanguageModel.get_peft_model(model, **LORA, use_gradient_checkpointing="unsloth", random_state=0)
    args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=G, gradient_accumulation_steps=1,
                      num_generations=G, max_completion_length=T, report_to="none", bf16=True, seed=0, **TRAINING)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=args,
                          reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * G}))
    if not type(trainer).__name__.startswith("Unsloth"):
        raise SystemExit(f"error: trl.GRPOTrainer is TRL's ({type(trainer).__module__}): `import unsloth` did not "
                         "patch it, so this would measure TRL 1.15, not Unsloth")
    return trainer


def enter_training(trainer) -> bool:
    """What Unsloth's train() does first (its prepare_for_training_mode): for_training with the checkpointing mode
    get_peft_model recorded ("unsloth": its offloaded checkpoints). Returns whether checkpointing is on."""
    model = trainer.model
    mode = getattr(model, "_unsloth_gradient_checkpointing", "unsloth")
    if hasattr(model, "for_training"):
        model.for_training(use_gradient_checkpointing=mode)
    else:
        model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by the loss
    return bool(mode)


def _is_oom(exc) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def worker_step(a):
    """Build, warm up, measure; print one RESULT json line (bench_step_memory's worker, for Unsloth's trainer)."""
    _site_first(a.site)
    import unsloth  # noqa: F401  (first: Unsloth patches transformers, PEFT and TRL on import)

    from grpo_accel.core.phase_memory import PhaseMemory

    mem = PhaseMemory("cuda")
    out = {"impl": IMPL}
    try:
        with tempfile.TemporaryDirectory() as tmp, mem.phase("load"):
            trainer = build(a, tmp)
            out["checkpointing"] = enter_training(trainer)
        out["steps"] = measure(a, trainer, mem, mem.records[-1].end_bytes)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        return harness.report(out | dict(oom=True, error=_first_line(exc)))
    out.update(oom=False, base_mib=mem.records[0].end_bytes / MIB, trainer=type(trainer).__name__,
               mini_batch=getattr(trainer.args, "unsloth_grpo_mini_batch", None))
    harness.report(out)


def measure(a, trainer, mem, base) -> dict:
    """A warm-up step, then --reps measured ones (with --reps 0 the first step is the measured one)."""
    import torch

    model = trainer.model
    G = a.num_generations
    inputs = fixed_batch(G, a.prompt_length, a.completion_length, model.config.get_text_config().vocab_size,
                         trainer.processing_class.pad_token_id, "cuda", a.equal_lengths)
    tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())  # real tokens, padding excluded
    lora = [p for p in model.parameters() if p.requires_grad]
    steps = []
    for name in ["warmup"] + [f"step{i}" for i in range(a.reps)]:
        model.zero_grad(set_to_none=True)
        with mem.phase(name):
            t0 = time.perf_counter()
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        rec = mem.records[-1]
        grads = [p.grad.float().norm() for p in lora if p.grad is not None]
        steps.append(dict(ms=ms, peak=(rec.peak_bytes - base) / MIB, total=rec.peak_bytes / MIB,
                          reserved=rec.reserved_bytes / MIB, held=(rec.start_bytes - base) / MIB,
                          loss=loss.item(), grad_norm=torch.linalg.vector_norm(torch.stack(grads)).item()))
        del loss
    measured = steps[1:] or steps
    return dict(time_ms=[s["ms"] for s in measured], tokens=tokens, warmup_steps=len(steps) - len(measured),
                **{k: max(s[k] for s in measured) for k in ("peak", "total", "reserved", "held")},
                loss=measured[0]["loss"], grad_norm=measured[0]["grad_norm"])


def worker_save(a):
    """The random checkpoint (random_models.save_random_model), in a process of its own: the parent never holds a
    CUDA context, and the Unsloth workers import nothing before unsloth."""
    sys.path.append(str(ROOT))  # grpo_accel.planning, where no editable install puts it on the path
    from campaign.random_models import save_random_model

    print(save_random_model(a.arch, Path(a.ckpt_cache), "bfloat16"), flush=True)


# ------------------------------------------------------------------------------------------------ parent side
def worker_env(args) -> dict:
    cache = Path(args.ckpt_cache).parent / "grpo_accel_unsloth_compiled"  # Unsloth writes generated code here
    return {**os.environ, **WORKER_ENV, "UNSLOTH_COMPILE_LOCATION": str(cache)}


def gpu_name() -> str:
    """torch.cuda.get_device_name() (the CSV's device column, as bench_step_memory writes it), asked in a short
    process of its own: asking here would hold a CUDA context (~0.5 GiB) on the GPU while the workers measure."""
    code = "import torch; print(torch.cuda.get_device_name())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def ensure_checkpoint(args) -> Path:
    path = Path(args.ckpt_cache) / args.arch
    if not (path / "config.json").exists():
        cmd = [sys.executable, __file__, "--worker", "save", "--arch", args.arch, "--ckpt-cache", str(args.ckpt_cache)]
        subprocess.run(cmd, check=True, cwd=ROOT / "benchmarks")
    return path


def run_worker(args, T, reps) -> dict:
    """One step in a fresh process, cwd a temporary folder (Unsloth leaves files where it runs)."""
    cmd = [sys.executable, __file__, "--worker", "step", "--arch", args.arch, "--quant", args.quant,
           "--num-generations", str(args.num_generations), "--prompt-length", str(args.prompt_length),
           "--completion-length", str(T), "--reps", str(reps), "--site", str(args.site),
           "--checkpoint", str(args.checkpoint)] + (["--equal-lengths"] if args.equal_lengths else [])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        run = harness.run_worker_process(cmd, worker_env(args), cwd, timeout_s=args.timeout_s)
    return parse_worker(run, T, time.perf_counter() - t0)


def parse_worker(run: dict, T: int, wall_s: float) -> dict:
    # bitsandbytes' and Unsloth's own kernels say "out of memory" without torch's "CUDA" prefix
    res = harness.worker_result(run, IMPL, f"T={T}", oom_texts=("OutOfMemoryError", "out of memory"))
    res["wall_s"] = wall_s
    return res


def failed(res) -> str | None:
    """Why a step gave no figures: "oom", "killed", "timed_out", or None when it ran."""
    return "oom" if res.get("oom") else "killed" if "killed_by_signal" in res else \
        "timed_out" if res.get("timed_out") else None


def step_rows(res, args, T) -> list[dict]:
    """bench_step_memory's metric names for the same quantities, so the summary reads both alike."""
    metrics = harness.failure_metrics(res)
    if not failed(res):
        s = res["steps"]
        ms = statistics.median(s["time_ms"])
        metrics += [
            ("peak_step_mem_mib", s["peak"], "MiB"), ("peak_step_mem_with_weights_mib", s["total"], "MiB"),
            ("peak_allocated_with_weights_mib", s["total"], "MiB"),
            ("peak_reserved_mib", s["reserved"] - res["base_mib"], "MiB"),
            ("peak_reserved_with_weights_mib", s["reserved"], "MiB"),
            ("step_time_ms", ms, "ms"), ("time_per_token_us", ms * 1e3 / s["tokens"], "us"),
            ("loss", s["loss"], "nats"), ("lora_grad_norm", s["grad_norm"], "l2"),
            ("held_between_steps_mib", s["held"], "MiB"), ("model_mem_mib", res["base_mib"], "MiB"),
            ("checkpointing", float(res["checkpointing"]), "bool"), ("reps", float(len(s["time_ms"])), "count"),
            ("warmup_steps", float(s["warmup_steps"]), "count"),
        ]
    return harness.long_rows("grpo_step_fwd_bwd", IMPL, shape(args, T), metrics)


def run_step(args, save) -> list[dict]:
    res = run_worker(args, args.completion_length, args.reps)
    print(f"{IMPL} T={args.completion_length}: {failed(res) or 'ran'} ({res['wall_s']:.0f} s)", flush=True)
    return save(step_rows(res, args, args.completion_length))


def find_max_t(args, save, probe=None) -> list[dict]:
    """Probe T upward (probe_lengths), each its own process (`probe(T)` -> a worker result); stop at the first that
    fails (OOM, killed or timed out). Each probe's step rows are saved as it ends; then the longest that fit."""
    probe = probe or (lambda T: run_worker(args, T, args.reps))
    longest, first_failed, count = 0, 0, 0
    for T in probe_lengths(args.completion_length, args.t_step, args.max_t):
        res = probe(T)
        count += 1
        print(f"{IMPL} T={T}: {failed(res) or 'fits'} ({res.get('wall_s', 0):.0f} s)", flush=True)
        save(step_rows(res, args, T))
        if failed(res):
            first_failed = T
            break
        longest = T
    rows = [dict(op="grpo_max_completion_length", impl=IMPL, shape=shape(args), metric=m, value=str(v), unit=u)
            for m, v, u in (("max_completion_length", longest, "tokens"), ("probes", count, "count"),
                            ("first_failed_t", first_failed, "tokens"))]
    return save(rows)


def recorded_max_t(path: Path, shape_str: str) -> int | None:
    """Unsloth's longest fitting T at `shape_str` (shape(args) of a --find-max-t run) from the CSV, None when not
    measured: what a campaign row reads to run ours at twice it."""
    if not Path(path).exists():
        return None
    with Path(path).open() as f:
        hits = [int(r["value"]) for r in csv.DictReader(f) if (r["op"], r["impl"], r["shape"], r["metric"])
                == ("grpo_max_completion_length", IMPL, shape_str, "max_completion_length")]
    return hits[-1] if hits else None


def preflight(args) -> int:
    """One line: whether `import unsloth` works here (in a worker with the site first) and what would run."""
    versions = site_versions(args.site)
    would = ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("unsloth", "unsloth_zoo", "transformers",
                                                                       "trl", "torch"))
    pins = pin_problems(args.site, versions) if site_has_unsloth(args.site) else []
    tail = f" | would run {would}" + (f" | {'; '.join(pins)}" if pins else "")
    if not site_has_unsloth(args.site):
        print(f"{PREFLIGHT_TAG} no Unsloth at UNSLOTH_SITE={args.site!r} (benchmarks/campaign/unsloth_wheels.sh, "
              f"docs/unsloth.md){tail}", flush=True)
        return EXIT_PREFLIGHT_FAILS
    with tempfile.TemporaryDirectory() as cwd:
        run = harness.run_worker_process([sys.executable, __file__, "--worker", "preflight", "--site",
                                          str(args.site)], worker_env(args), cwd, timeout_s=args.timeout_s)
    lines = [ln for ln in run["stdout"].splitlines() if ln.startswith(PREFLIGHT_TAG)]
    line = lines[-1] if lines else (f"{PREFLIGHT_TAG} the worker ended without a word (rc {run['returncode']}): "
                                    + (run["stderr"].strip().splitlines() or [""])[-1][:200])
    print(line + tail, flush=True)
    return 0 if run["returncode"] == 0 and lines else EXIT_PREFLIGHT_FAILS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["step", "preflight", "save"], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--preflight", action="store_true", help="say whether `import unsloth` works here and which "
                   "Unsloth / transformers / TRL would run (one line; exit 0 if it works, 3 if not)")
    p.add_argument("--site", default=os.environ.get("UNSLOTH_SITE"), help="the Unsloth site directory "
                   "(default: $UNSLOTH_SITE), first on the worker's sys.path")
    p.add_argument("--arch", default="qwen3-8b", help="a name from grpo_accel.planning.architectures")
    p.add_argument("--quant", default="none", choices=["none", "4bit"], help="4bit = QLoRA (load_in_4bit)")
    p.add_argument("--num-generations", type=int, default=8, help="G: rows in the step")
    p.add_argument("--prompt-length", type=int, default=64, help="P: prompt tokens per row")
    p.add_argument("--completion-length", type=int, default=32768, help="T (--find-max-t: the first probe)")
    p.add_argument("--equal-lengths", action="store_true", help="every completion T tokens (default: T/2..T)")
    p.add_argument("--reps", type=int, default=1, help="measured steps after one warm-up (0: the first step is "
                   "the measured one)")
    p.add_argument("--find-max-t", action="store_true", help="probe T upward by --t-step until a step fails")
    p.add_argument("--t-step", type=int, default=32768, help="--find-max-t's step (tokens)")
    p.add_argument("--max-t", type=int, default=262144, help="--find-max-t's last probe (tokens)")
    p.add_argument("--timeout-s", type=float, default=600, help="per worker process; past it the step is a "
                   "timed_out row (and --find-max-t stops)")
    p.add_argument("--ckpt-cache", type=Path, default=Path(tempfile.gettempdir()) / "grpo_accel_bench_ckpt",
                   help="the random checkpoints' folder (bench_step_memory's default: one save per arch)")
    p.add_argument("--out", type=Path, default=RESULTS / "step_memory.csv")
    p.add_argument("--resume", action="store_true", help="skip what --out already has from this sha and device")
    p.add_argument("--with-ours", nargs="*", metavar="IMPL", default=None,
                   help="first run bench_step_memory.py's IMPLs (default: ours_mb1 trl_tuned) at the same shape, in "
                        "this call, into the same CSV (its --resume: an IMPL measured at this sha is not run again)")
    return p.parse_args(argv)


OURS = ("ours_mb1", "trl_tuned")  # --with-ours: what an Unsloth figure is compared with, measured in the same call


def ours_command(args) -> list[str]:
    """bench_step_memory.py at this run's shape: the same flags, so its CSV shape is this one's (one pairing key)."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_step_memory.py"), "--impls",
           *(args.with_ours or OURS), "--arch", args.arch, "--quant", args.quant, "--num-generations",
           str(args.num_generations), "--prompt-length", str(args.prompt_length), "--completion-length",
           str(args.completion_length), "--reps", str(args.reps), "--ckpt-cache", str(args.ckpt_cache), "--out",
           str(args.out), "--resume"]
    return cmd + (["--equal-lengths"] if args.equal_lengths else [])


def refuse(args) -> str | None:
    """The `error:` line when a measuring mode cannot run here, else None."""
    import torch

    if not torch.cuda.is_available():
        return NO_GPU
    if not site_has_unsloth(args.site):
        return NO_SITE.format(site=args.site)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return {"step": worker_step, "preflight": worker_preflight, "save": worker_save}[args.worker](args) or 0
    if args.preflight:
        return preflight(args)
    problem = refuse(args)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    meta = (versions_field(site_versions(args.site)), harness.run_meta("cpu", ())[1], gpu_name())
    run = harness.Results(args.out, meta, resume=args.resume)
    op, metric = ("grpo_max_completion_length", "max_completion_length") if args.find_max_t else (
        "grpo_step_fwd_bwd", "oom")
    if run.skip(op, IMPL, shape(args, None if args.find_max_t else args.completion_length), metric):
        return 0
    ours_failed = False
    if args.with_ours is not None and not args.find_max_t:
        # ours and tuned TRL first, in this call: the same GPU state, checkpoint and sha as Unsloth's figure
        print(f"[unsloth] ours first: {' '.join(ours_command(args)[1:])}", flush=True)
        ours_failed = subprocess.run(ours_command(args), cwd=ROOT).returncode != 0
    args.checkpoint = ensure_checkpoint(args)
    rows = (find_max_t if args.find_max_t else run_step)(args, run.save)  # each probe's rows saved as it ends
    return 1 if ours_failed or any(r["metric"] == "killed_by_signal" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
