"""`grpo-accel presets` and `grpo-accel plan`: output and exit codes.

    OMP_NUM_THREADS=1 pytest tests/test_cli.py
"""

import os
import subprocess
import sys
from pathlib import Path

from grpo_accel.app.cli import main
from grpo_accel.app.presets import PRESETS, get_preset

REPO = Path(__file__).resolve().parent.parent


def test_presets_table_lists_every_preset_aligned(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rule = lines[0], lines[1]
    assert header.split()[:2] == ["preset", "GPU"] and "peak GiB" in header and "accelerate YAML" in header
    rows = {line.split()[0]: line for line in lines[2:2 + len(PRESETS)]}
    assert list(rows) == list(PRESETS)
    yaml_col = header.index("accelerate YAML")
    for name, line in rows.items():
        assert line[yaml_col:].strip() == f"{name}.yaml"  # columns line up
        assert f"{get_preset(name).plan().peak_gib:.1f}" in line
    assert len(rule) >= len(header)


def test_plan_fits_exit_zero(capsys):
    assert main(["plan", "--preset", "h100_110k", "--gpu-mem-gib", "79.1", "--stack", "pinned"]) == 0
    out = capsys.readouterr().out
    assert "recompute_working_set" in out and "host: activations_offloaded" in out
    assert "fits: predicted peak" in out and "vLLM gpu_memory_utilization" in out


def test_plan_not_fitting_exits_nonzero_and_names_a_fix(capsys):
    code = main(["plan", "--preset", "l4_24gb_qlora", "--max_completion_length", "65536", "--gpu-mem-gib", "12"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit" in out and "--max_completion_length " in out


def test_plan_without_vllm_fits_by_continuous_batching_where_generate_did_not(capsys):
    """Issue 45: on this machine (no vLLM) 8 x 66K tokens of generate()'s whole-batch cache did not fit 22 GiB; the
    paged route holds the sequences that fit at once and queues the rest."""
    code = main(["plan", "--preset", "l4_24gb_qlora", "--max_completion_length", "65536", "--gpu-mem-gib", "22"])
    out = capsys.readouterr().out
    assert code == 0 and "generation route continuous_batching" in out and "full-length sequences at once" in out
    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.planning.routes import Stack

    spec = resolve_run_spec(["--preset", "l4_24gb_qlora", "--max_completion_length", "65536"], for_plan=True)
    spec.stack = Stack(vllm=False, bnb_4bit=False, cuda=True, continuous_batching=False)  # transformers < 5.8
    assert spec.plan().device["generate_kv_cache"] > 22 * 2**30  # generate(): the whole batch's cache alone


def test_plan_overrides_model_and_switches(capsys):
    code = main(["plan", "--preset", "h100_110k", "--model", "llama-3.2-1b", "--offload_activations", "false",
                 "--max_completion_length", "4096", "--model_init_kwargs", "{}", "--gpu-mem-gib", "80"])
    out = capsys.readouterr().out
    assert code == 0 and "model llama-3.2-1b" in out and "activations_offloaded" not in out


def test_plan_bad_preset_is_a_clear_error(capsys):
    assert main(["plan", "--preset", "h100"]) == 2
    assert "valid presets: cpu" in capsys.readouterr().err


def test_module_entry_point_exit_code():
    """`python -m grpo_accel.app.cli` runs main() and hands its exit code to the shell (the 0 path of main() is tested
    in-process above; one subprocess is enough for the wiring: 10 s of imports each)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    bad = subprocess.run([sys.executable, "-m", "grpo_accel.app.cli", "plan", "--preset", "t4_qlora",
                          "--gpu-mem-gib", "4"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not fit" in bad.stdout and "fits:" not in bad.stdout


def test_plan_reads_the_flags_train_reads(capsys):
    """The flags the old pre-load check ignored change the plan, exactly as they change the run."""
    from grpo_accel.app.run_spec import resolve_run_spec

    base = resolve_run_spec(["--preset", "h100_110k"], for_plan=True).plan()
    for flag, value, term in [("--quantization", "none", "weights"), ("--offload_activations", "false",
                              "activations_checkpointed"), ("--logprob_impl", "trl", "logprob_workspace"),
                              ("--per_device_train_batch_size", "2", "activations_checkpointed"),
                              ("--offload_recompute_tokens", "65536", "recompute_working_set"),
                              ("--offload_device_budget_gib", "4", "activations_checkpointed")]:
        changed = resolve_run_spec(["--preset", "h100_110k", flag, value], for_plan=True).plan()
        assert changed.device[term] > base.device[term], flag
        assert main(["plan", "--preset", "h100_110k", flag, value, "--gpu-mem-gib", "80"]) in (0, 1)
        assert f"{term}" in capsys.readouterr().out
    assert changed.inputs["offload_device_budget_bytes"] == 4 * 2**30


def test_plan_unknown_flag_suggests_the_right_one(capsys):
    assert main(["plan", "--preset", "cpu", "--max_completion_lenght", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown flag --max_completion_lenght; did you mean --max_completion_length?")


def test_plan_find_max_t_grows_with_the_gpu_and_names_the_context(capsys):
    import re

    found = {}
    for gib in (40, 80):
        assert main(["plan", "--preset", "h100_110k", "--find-max-t", "--gpu-mem-gib", str(gib),
                     "--host-mem-gib", "120"]) == 0
        out = capsys.readouterr().out
        found[gib] = int(re.search(r"longest completion that fits .*: (\d+) tokens", out).group(1))
        assert "context caps it at 130560 tokens" in out or found[gib] <= 130560
    assert 0 < found[40] < found[80] and found[80] % 128 == 0


def test_every_suggested_fix_is_a_train_flag():
    """The planner's fixes name flags launch/train.py has (they once named planner-only switches)."""
    import re

    from grpo_accel.app.run_spec import RunParser
    from grpo_accel.planning.memory import plan_memory

    flags = set(RunParser().flag_names())
    for kw in (dict(lora_r=16, logprob_impl="trl", use_vllm=True, vllm_share_weights=False),
               dict(lora_r=0, gradient_checkpointing=False, per_device_train_batch_size=8),
               dict(lora_r=16, gradient_checkpointing=True, offload_activations=False)):
        verdict = plan_memory("llama-3.1-8b", max_completion_length=32768, **kw).verdict(8 * 2**30)
        named = re.findall(r"(--[a-z_]+)", verdict.message)
        assert named and set(named) <= flags, named


def test_plan_for_another_machine_warns_what_this_one_lacks(capsys, monkeypatch):
    """8xh100_sp8_512k trained in full needs vLLM's client on the training machine (TRL's server mode); the laptop
    that plans it does not: a missing client is a warning and the plan exits 0. As shipped (QLoRA) the adapter sync
    speaks HTTP and needs no vLLM there: no warning. A plan that cannot run anywhere still exits 1."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as without vLLM installed
    assert main(["plan", "--preset", "8xh100_sp8_512k"]) == 0
    out = capsys.readouterr().out
    assert "fits: predicted peak" in out and not any(line.startswith("warning:") for line in out.splitlines()), out
    assert main(["plan", "--preset", "8xh100_sp8_512k", "--quantization", "none", "--lora_r", "0"]) == 0
    out = capsys.readouterr().out
    assert "fits: predicted peak" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "this machine lacks vLLM" in warnings[0], out
    assert "the run's machine needs it" in warnings[0] and not any(line.startswith("error:") for line in
                                                                     out.splitlines())

    assert main(["plan", "--preset", "8xh100_zero3", "--use_vllm", "true"]) == 1  # the plan itself is invalid
    out = capsys.readouterr().out
    assert any(line.startswith("error: colocated vLLM under DeepSpeed ZeRO-3") for line in out.splitlines()), out


def test_plan_warns_for_each_missing_client_package(capsys, monkeypatch):
    """bitsandbytes (4-bit), DeepSpeed (ZeRO / SP), flash-attn (a flash attention kernel): each one missing here is one
    warning line; none of them changes the exit code."""
    for module in ("bitsandbytes", "deepspeed", "flash_attn"):
        monkeypatch.setitem(sys.modules, module, None)
    # generate() on these GPUs (no vLLM client warning) at a length its whole-batch KV cache fits
    assert main(["plan", "--preset", "8xh100_sp8_512k", "--use_vllm", "false", "--max_completion_length", "16384"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "lacks bitsandbytes" in warnings[0] and "lacks DeepSpeed" in warnings[1], out
    assert main(["plan", "--preset", "h100_110k", "--stack", "pinned", "--model_init_kwargs", '{"attn_implementation": '
                 '"flash_attention_2", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, '
                 '"original_max_position_embeddings": 32768, "rope_theta": 1000000}}']) == 0
    out = capsys.readouterr().out
    assert "warning: this machine lacks flash-attn" in out and "lacks DeepSpeed" not in out, out


def test_plan_on_a_smaller_gpu_plans_for_the_presets_and_warns(capsys, monkeypatch):
    """Planning h100_110k on an L4 plans for the preset's GPU and says this one is not it (it used to plan for the
    L4 and exit 1); an H100 here is planned for as before, with no warning."""
    from grpo_accel.app.presets import GPUProps

    monkeypatch.setattr("grpo_accel.app.presets.current_gpu_props", lambda: GPUProps("NVIDIA L4", 22 * 2**30, 8, 9, 1))
    assert main(["plan", "--preset", "h100_110k", "--stack", "pinned"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory: 75.0 GiB (h100_110k's minimum)" in out
    assert "warning: this machine's GPU is not the run's (preset h100_110k needs ≥ 75 GiB" in out, out
    monkeypatch.setattr("grpo_accel.app.presets.current_gpu_props",
                        lambda: GPUProps("NVIDIA H100 80GB HBM3", int(79.1 * 2**30), 9, 0, 1))
    monkeypatch.setattr("grpo_accel.app.startup_checks.host_memory_bytes", lambda: 120 * 2**30)
    assert main(["plan", "--preset", "h100_110k", "--stack", "pinned"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory: 79.1 GiB (NVIDIA H100 80GB HBM3)" in out and "warning:" not in out, out
