"""benchmarks/bench_unsloth.py on CPU (Unsloth's step itself needs a GPU loan): the preflight line and its exit codes,
the refusal without a GPU, the worker's site shadowing our TRL, the fixed batch and CSV shape bench_step_memory makes
for the same sizes (so the judge pairs the rows), the find-max-t probes and the rows they leave. ~15 s on 2 cores."""

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_unsloth.py"
FIELDS = ["op", "impl", "shape", "metric", "value", "unit", "device", "versions", "git_sha", "date"]


@pytest.fixture
def bu(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_unsloth

    return bench_unsloth


def run_script(*argv, site=None, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k != "UNSLOTH_SITE"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **(extra_env or {}))
    if site:
        env["UNSLOTH_SITE"] = str(site)
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def fake_site(tmp_path, unsloth_init, trainer_name="UnslothGRPOTrainer", pins=("transformers<=4.0.0",)):
    """A site as unsloth_wheels.sh installs it, in miniature: unsloth (its __init__ given), a trl 1.15.0 whose
    GRPOTrainer has `trainer_name`, and their dist-info (what the preflight reads the versions and pins from)."""
    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text(textwrap.dedent(unsloth_init))
    (site / "trl").mkdir()
    (site / "trl" / "__init__.py").write_text(f"class {trainer_name}:\n    pass\n\nGRPOTrainer = {trainer_name}\n")
    for name, version, requires in (("unsloth", "2026.10.9", pins), ("trl", "1.15.0", ())):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        lines = [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")
    return site


# ------------------------------------------------------------------------------------------------ preflight
def test_preflight_without_a_site_is_one_line_and_exit_3():
    proc = run_script("--preflight")
    assert proc.returncode == 3, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight: no Unsloth at UNSLOTH_SITE=None"), proc.stdout
    assert "unsloth_wheels.sh" in lines[0]
    import trl

    assert f"trl {trl.__version__}" in lines[0], "what would run without a site: this environment's TRL"


def test_preflight_reports_unsloths_refusal_with_the_sites_versions(tmp_path):
    """Unsloth refuses to import without a GPU: one line with its reason, the site's TRL (1.15.0) ahead of ours, and
    the version Unsloth's own pins exclude."""
    site = fake_site(tmp_path, """
        raise NotImplementedError("Unsloth cannot find any torch accelerator? You need a GPU.")
    """)
    proc = run_script("--preflight", site=site)
    assert proc.returncode == 3, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    assert "import unsloth fails here: NotImplementedError: Unsloth cannot find any torch accelerator" in line
    assert "unsloth 2026.10.9" in line and "trl 1.15.0" in line
    import transformers

    assert f"transformers {transformers.__version__} outside unsloth's <=4.0.0" in line


@pytest.mark.parametrize("trainer_name, code", [("UnslothGRPOTrainer", 0), ("GRPOTrainer", 3)])
def test_preflight_exit_code_says_whether_trl_was_patched(tmp_path, trainer_name, code):
    """0 only when `import unsloth` works and trl.GRPOTrainer is then Unsloth's: a worker that imported our TRL 1.16
    (the site not first) or an unpatched one would measure TRL, not Unsloth."""
    site = fake_site(tmp_path, "DEVICE_TYPE = 'cuda'\n", trainer_name, pins=())
    proc = run_script("--preflight", site=site)
    assert proc.returncode == code, proc.stdout + proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    assert ("GRPOTrainer is UnslothGRPOTrainer" in line) == (code == 0), line
    assert "trl 1.15.0" in line


# ------------------------------------------------------------------------------------------------ no GPU
def test_a_measuring_mode_without_gpu_exits_2_with_one_error_line():
    proc = run_script("--arch", "llama-3.1-8b", "--completion-length", "19968")
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: bench_unsloth.py needs a CUDA GPU") and "--preflight" in line


def test_find_max_t_without_gpu_and_a_gpu_without_site_exit_2(bu, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bu.main(["--find-max-t", "--out", str(tmp_path / "x.csv")]) == 2
    assert capsys.readouterr().err.startswith("error: bench_unsloth.py needs a CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bu.main(["--site", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Unsloth site") and "pip install --no-index --no-deps --target" in err
    assert not (tmp_path / "x.csv").exists()


# ------------------------------------------------------------------------------------------ same batch, same shape
def test_fixed_batch_is_bench_step_memorys_with_unsloths_padding(bu):
    """The same lengths (T/2..T), masks, advantages and old log-probs as bench_step_memory's batch; padding carries
    the pad id (Unsloth finds padding by id) and no real token does (V=5, pad 4: half the random ids collide)."""
    import bench_step_memory as bsm

    G, P, T, V, pad = 4, 5, 9, 5, 4
    ours, theirs = bsm.make_inputs(G, P, T, V, "cpu"), bu.fixed_batch(G, P, T, V, pad)
    assert theirs["completion_mask"].sum(1).tolist() == bsm.completion_lengths(G, T) == [4, 5, 7, 9]
    for key in ("prompt_mask", "completion_mask", "advantages", "old_per_token_logps", "num_items_in_batch"):
        assert torch.equal(theirs[key], ours[key]), key
    for ids, mask in (("prompt_ids", "prompt_mask"), ("completion_ids", "completion_mask")):
        real = ours[mask].bool()
        assert (theirs[ids][~real] == pad).all() and (theirs[ids][real] != pad).all(), ids
        kept = real & (ours[ids] != pad)
        assert kept.any() and torch.equal(theirs[ids][kept], ours[ids][kept]), ids


@pytest.mark.parametrize("flags, T", [
    (["--arch", "llama-3.1-8b", "--num-generations", "8", "--prompt-length", "512", "--completion-length", "19968"],
     19968),
    (["--arch", "qwen3-8b", "--quant", "4bit", "--num-generations", "8", "--completion-length", "32768"], 32768),
    (["--arch", "qwen3-8b", "--quant", "4bit", "--num-generations", "8", "--t-step", "32768"], None),
])
def test_csv_shape_is_bench_step_memorys_for_the_same_flags(bu, monkeypatch, flags, T):
    import bench_step_memory as bsm

    monkeypatch.setattr(sys, "argv", ["bench_step_memory.py", *flags, "--device", "cuda"])
    expected = bsm._shape(bsm.parse_args(), T)
    assert bu.shape(bu.parse_args(flags), T) == expected
    if T == 19968:
        assert expected == "llama-3.1-8b,lora-r16,G=8,P=512,T=19968,bf16,padded"


@pytest.mark.parametrize("flags", [
    ["--arch", "llama-3.1-8b", "--num-generations", "2", "--prompt-length", "512", "--completion-length", "19968"],
    ["--arch", "qwen3-8b", "--quant", "4bit", "--num-generations", "2", "--completion-length", "32768",
     "--equal-lengths"],
])
def test_with_ours_runs_our_step_at_unsloths_csv_shape(bu, monkeypatch, flags):
    """--with-ours: bench_step_memory.py with the flags it is handed writes its rows under Unsloth's CSV shape (the
    judge's pairing key), resumes what this sha measured, and runs ours and tuned TRL by default."""
    import bench_step_memory as bsm

    args = bu.parse_args([*flags, "--with-ours"])
    cmd = bu.ours_command(args)
    assert Path(cmd[1]).name == "bench_step_memory.py" and "--resume" in cmd
    monkeypatch.setattr(sys, "argv", [*cmd[1:], "--device", "cuda"])
    ours = bsm.parse_args()
    T = args.completion_length
    assert bsm._shape(ours, T) == bu.shape(args, T)
    assert ours.impls == ["ours_mb1", "trl_tuned"] and ours.out == args.out and ours.reps == args.reps


def test_training_values_are_the_ones_our_rows_get_from_trl(bu, tmp_path):
    """Unsloth's GRPOConfig has its own defaults: the worker pins our rows' (TRL's GRPOConfig defaults)."""
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    got = {k: getattr(cfg, k) for k in bu.TRAINING}
    got["optim"] = getattr(got["optim"], "value", got["optim"])
    assert got == bu.TRAINING
    assert bu.LORA["r"] == 16 and bu.LORA["lora_alpha"] == 32 and len(bu.LORA["target_modules"]) == 7


# ------------------------------------------------------------------------------------------------ find-max-t
def test_probe_lengths_grow_by_the_step(bu):
    assert bu.probe_lengths(65536, 32768, 196608) == [65536, 98304, 131072, 163840, 196608]
    assert bu.probe_lengths(65536, 32768, 65535) == []


def fake_result(oom=False, **extra):
    steps = dict(time_ms=[1000.0], tokens=1000, warmup_steps=1, peak=500.0, total=20000.0, reserved=30000.0,
                 held=0.0, loss=0.1, grad_norm=1.0)
    return dict(impl="unsloth", oom=True, error="CUDA out of memory") if oom else dict(
        impl="unsloth", oom=False, steps=steps, base_mib=17000.0, checkpointing=True, **extra)


@pytest.mark.parametrize("failure", ["oom", "killed"])
def test_find_max_t_stops_at_the_first_failure_and_records_it(bu, tmp_path, failure):
    """Each probe's rows go to the CSV as it ends (an OOM is a row, oom=1), no probe after the first failure, then
    the longest that fit; recorded_max_t reads it back for the campaign (ours at twice it)."""
    args = bu.parse_args(["--quant", "4bit", "--completion-length", "65536", "--t-step", "32768", "--max-t", "262144"])
    probed = []

    def probe(T):
        assert T not in probed and (not probed or probed[-1] < 131072), "probed past the first failure"
        probed.append(T)
        if T < 131072:
            return fake_result()
        return fake_result(oom=True) if failure == "oom" else dict(impl="unsloth", oom=False, killed_by_signal=9)

    out = tmp_path / "step_memory.csv"
    save = lambda rows: bu.harness.write_results(rows, out, ("unsloth=2026.10.9 trl=1.15.0", "abc", "NVIDIA H100"))  # noqa: E731
    bu.find_max_t(args, save, probe)
    assert probed == [65536, 98304, 131072]
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == FIELDS
        rows = list(reader)
    assert {r["impl"] for r in rows} == {"unsloth"}
    assert {r["versions"] for r in rows} == {"unsloth=2026.10.9 trl=1.15.0"}
    at = lambda T: {r["metric"]: float(r["value"]) for r in rows if r["shape"] == bu.shape(args, T)}  # noqa: E731
    assert at(98304)["oom"] == 0 and at(98304)["peak_allocated_with_weights_mib"] == 20000
    assert at(98304)["peak_step_mem_with_weights_mib"] == 20000 and at(98304)["peak_reserved_with_weights_mib"] == 30000
    assert at(98304)["time_per_token_us"] == pytest.approx(1000.0)
    assert (at(131072).get("oom"), at(131072).get("killed_by_signal")) == ((1, None) if failure == "oom" else (None, 9))
    assert "step_time_ms" not in at(131072)
    summary = at(None)
    assert (summary["max_completion_length"], summary["probes"], summary["first_failed_t"]) == (98304, 3, 131072)
    assert bu.recorded_max_t(out, bu.shape(args)) == 98304
    assert bu.recorded_max_t(out, bu.shape(bu.parse_args(["--arch", "llama-3.1-8b"]))) is None
