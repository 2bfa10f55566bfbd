"""Mixture-of-experts twins (issue 36) under 2-process DDP and ZeRO-3 through `accelerate launch ...
launch/train.py`: our savers on the policy pass (fused head, packed rows, the prompt once per group, the router loss
taken once over every forward: head/router_loss.py) against TRL's own policy pass (its head, padded rows, every
prompt G times, its router loss) in the same launcher, step by step. Under ZeRO-3 the experts' 3-D parameters and
gpt-oss's sinks are partitioned and gathered per layer; under DDP (LoRA, the cpu preset) Qwen3-MoE's expert adapters
are reduced with the rest. One launch ~15 s on 2 cores."""

import csv
import os

import pytest
from support.launch import DDP_YAML, ROOT, run_train

pytestmark = pytest.mark.distributed
ACCELERATE = os.path.join(os.path.dirname(os.sys.executable), "accelerate")
COMMON = ["--eval_size", "2", "--eval_max_new_tokens", "4", "--max_steps", "2", "--save_steps", "100",
          "--rewards", "support.rewards:length_reward", "--gradient_checkpointing", "true"]
OURS = ["--logprob_impl", "auto", "--padding_free", "true", "--share_prompt", "true"]
TRLS = ["--logprob_impl", "trl", "--padding_free", "false", "--share_prompt", "false"]


def launch(tmp_path, launcher: str, model: str, flags: list[str]):
    if launcher == "ddp":
        config = tmp_path / "cpu_ddp.yaml"
        config.write_text(DDP_YAML)
    else:
        config = os.path.join(ROOT, "accelerate_configs", f"cpu_{launcher}.yaml")
    out = tmp_path / f"{launcher}-{model}-{flags[1]}"
    result = run_train([*COMMON, "--model", model, "--output_dir", str(out), *flags], timeout=400,
                       launcher=[ACCELERATE, "launch", "--config_file", str(config)])
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return list(csv.DictReader(open(out / "metrics.csv"))), result.stdout


# ZeRO-3 partitions the experts' parameters (both twins), DDP reduces Qwen3-MoE's expert adapters; ZeRO-2, which
# partitions only gradients and optimizer states (flat, whatever a parameter's shape), is test_distributed.py's on the
# dense model (a gpt-oss case here took ~45 s of CI for what ZeRO-3's gathers already cover)
@pytest.mark.parametrize("launcher,model", [("zero3", "tiny-gpt-oss"), ("zero3", "tiny-qwen3-moe"),
                                            ("ddp", "tiny-qwen3-moe")])
def test_moe_savers_equal_trls_policy_pass_across_processes(tmp_path, launcher, model):
    ours, stdout = launch(tmp_path, launcher, model, OURS)
    assert "log-prob head: chunked" in stdout and "padding_free: log-prob passes run on packed rows" in stdout
    assert "share_prompt=true" in stdout or "run each prompt once" in stdout
    trls, stdout = launch(tmp_path, launcher, model, TRLS)
    assert "log-prob head: trl" in stdout and "padding_free: log-prob passes run on packed rows" not in stdout
    assert len(ours) == len(trls) == 2
    for a, b in zip(ours, trls):
        assert float(a["aux_loss"]) > 0  # the router loss ran (both configs ask TRL for it)
        assert float(a["share_prompt/token_ratio"]) < 1  # the prompt ran once per group
        for key in ("loss", "grad_norm", "entropy", "aux_loss", "reward"):
            # as test_distributed's head comparison: chunked vs TRL's summation order
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-4, abs=1e-7), key
    assert float(ours[0]["grad_norm"]) > 0
