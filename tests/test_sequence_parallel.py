"""Ulysses sequence parallelism (grpo_accel/parallel/sequence_parallel.py) with SP = 2 over gloo equals one process
without it: the group's two ranks hold the same batch, each runs half of every row's tokens, and both get the
one-process per-token log-probs, entropies and TRL loss; the LoRA gradients averaged over the ranks (as the engine
does) equal the one-process gradients (fp32, <= 1e-5 relative). tiny-llama with LoRA on q/v/down, completions of
unequal length, layer offload with gradient checkpointing (the checkpoint's re-run in backward goes through Ulysses'
all-to-all again, one row at a time, in sequence tiles whose attention reaches the other rank's keys:
parallel/ulysses_tiles.py). How the ranks come to hold the same rows (sampler, generation split over the group, RNG)
is checked by the launches below and by test_group_shared_sampler_deals_each_batch_to_one_group. Measured: log-probs
9.5e-7 abs, loss equal, gradients 3.8e-7 relative; 1.4e-2 with the tiles' dK dropped."""

import math
import os
import sys

import pytest
import torch
from support.compare import assert_rel_close, rel_norm
from support.launch import ROOT, WORKERS, child_env, free_port, run_process_group

pytestmark = pytest.mark.distributed


CASES = ("tiny-llama", "tiny-qwen3-moe", "tiny-gpt-oss:full")


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """One launch of the worker for every case below (model -> each rank's results): one start-up instead of three."""
    out = tmp_path_factory.mktemp("sp") / "sp.pt"
    cmd = [sys.executable, os.path.join(WORKERS, "sequence_parallel_worker.py"), "--offload",
           "--out", str(out), "--port", str(free_port()), "--cases", *CASES]
    result = run_process_group(cmd, 400, cwd=ROOT, env=child_env())
    assert result.returncode == 0, result.stderr[-4000:]
    models = [case.partition(":")[0] for case in CASES]
    return {m: [torch.load(f"{out}.{m}.rank{rank}") for rank in (0, 1)] for m in models}


@pytest.fixture(scope="module")
def sp_results(sp_runs):
    return sp_runs["tiny-llama"]


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_sp2_half_precision_equals_one_process_within_its_rounding(sp_results, half):
    """SP x bf16 / fp16 (docs/pairs.md): the same SP = 2 step (offload, tiles of 8 on each shard) under CPU autocast.
    SP's shards run other matmul shapes than one process's rows, so they round differently: each of log-probs, loss
    and every LoRA grad must be within 2x one process's own half-precision error against its fp32 result (and that
    error < 10%). A shard attending to the wrong keys, or a grad scaled by the SP size, is off by O(1)."""
    for r in sp_results:
        ref32, ref, sp, scored = r["ref"], r["ref"]["half"][half], r["sp"]["half"][half], r["mask"].bool()
        for key in ("logps", "entropy"):
            err = rel_norm(ref[key][scored], ref32[key][scored])
            assert 0 < err < 0.1 and rel_norm(sp[key][scored], ref[key][scored]) <= 2 * err, (key, err)
        err = abs(ref["loss"].item() - ref32["loss"].item()) / abs(ref32["loss"].item())
        assert abs(sp["loss"].item() - ref["loss"].item()) / abs(ref32["loss"].item()) <= 2 * err + 1e-3
        assert sp["grads"].keys() == ref["grads"].keys() == ref32["grads"].keys()
        for name, g in ref["grads"].items():
            err = rel_norm(g, ref32["grads"][name])
            assert 0 < err < 0.1 and rel_norm(sp["grads"][name], g) <= 2 * err, (name, err)


def test_sp2_equals_one_process(sp_results):
    results = sp_results
    halves = {(max(n for r in results for n in r["row_tokens"].tolist()) + 1) // 2}
    for r in results:
        ref, sp, scored = r["ref"], r["sp"], r["mask"].bool()
        assert sp["sp_calls"] == 2  # the no-grad pass and the loss's policy pass went through SP
        # SP's attention stood in for stock SDPA process-wide while on, and is gone once removed
        assert sp["sdpa_patched"] and sp["sdpa_after_remove"]
        assert sp["sp_head_installed"] and not sp["sp_head_after_remove"]
        # the batch's rows ran in one forward, padded to the longest, as 2 shards of half its tokens: B rows per
        # rank, not the group's 2·B
        assert set(sp["shard_lengths"]) == halves and max(sp["shard_rows"]) == len(r["row_tokens"])
        # with offload, each layer's re-run went through the shard's sequence tiles of 8 tokens: 4 tiles for each
        # of 4 row groups (a 26-token shard row is longer than the 8-token piece) in each of 2 layers
        assert sp["layer_tiles"] == [4] * 8
        assert rel_norm(sp["logps"][scored], ref["logps"][scored]) <= 1e-5
        assert rel_norm(sp["entropy"][scored], ref["entropy"][scored]) <= 1e-5
        assert sp["loss"].item() == pytest.approx(ref["loss"].item(), rel=1e-5) and ref["loss"].abs() > 1e-3
        assert ref["grads"].keys() == sp["grads"].keys() and len(ref["grads"]) == 12
        assert_rel_close(ref["grads"], sp["grads"], 1e-5, nonzero=True)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_sp2_moe_equals_one_process(sp_runs, model):
    """SP x MoE: the MoE twins (router loss off: SP refuses it) through the same worker with offload on each shard:
    log-probs, entropies, loss and grads equal one process's. Qwen3-MoE: LoRA (PEFT's adapters on q, v and every
    expert's down_proj). gpt-oss: full fine-tuning, so its sinks, sharded with their heads after the all-to-all, get
    gradients, and its sliding layers' windows (4 tokens) cross the 8-token tiles and the shard boundary. Both
    re-run their layers in Ulysses' shard tiles (parallel/ulysses_tiles.py: sinks and windows since issue 36). They
    run after tiny-llama's case in the same processes, so SP's removal there is checked again here."""
    qwen = model == "tiny-qwen3-moe"
    for r in sp_runs[model]:
        ref, sp, scored = r["ref"], r["sp"], r["mask"].bool()
        assert sp["sp_calls"] == 2 and sp["layer_tiles"] and all(n > 1 for n in sp["layer_tiles"])
        assert qwen or any(n.endswith("sinks") for n in ref["grads"])
        assert rel_norm(sp["logps"][scored], ref["logps"][scored]) <= 1e-5
        assert rel_norm(sp["entropy"][scored], ref["entropy"][scored]) <= 1e-5
        assert sp["loss"].item() == pytest.approx(ref["loss"].item(), rel=1e-5) and ref["loss"].abs() > 1e-3
        assert ref["grads"].keys() == sp["grads"].keys() and any("experts" in n for n in ref["grads"])
        assert_rel_close(ref["grads"], sp["grads"], 1e-5, nonzero=True)


ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
LAUNCH_ARGS = ["--eval_size", "2", "--eval_max_new_tokens", "4", "--max_steps", "2", "--save_steps", "100",
               "--rewards", "support.rewards:length_reward", "--gradient_checkpointing", "true",
               "--offload_activations", "true"]


def launch(preset, tmp_path, *extra, config=None):
    import csv

    from support.launch import run_train

    out = tmp_path / (preset if config is None else f"{preset}-{os.path.basename(config)}")
    config = config or os.path.join(ROOT, "accelerate_configs", f"{preset}.yaml")
    result = run_train([*LAUNCH_ARGS, *extra, "--output_dir", str(out)],
                       launcher=[ACCELERATE, "launch", "--config_file", config], timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return list(csv.DictReader(open(out / "metrics.csv"))), result.stdout


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    """The data-parallel equivalent of an SP = 2 group of 4 rows: the preset's run with 2 rows per process, launched
    once per preset (cpu_zero3 samples other completions than cpu_zero2: its model is built under ZeRO-3's init)."""
    runs = {}

    def run(preset="cpu_zero2"):
        if preset not in runs:
            runs[preset] = launch(preset, tmp_path_factory.mktemp("dp"), "--per_device_train_batch_size", "2")[0]
        return runs[preset]
    return run


def assert_first_step_equal(sp, plain):
    assert len(sp) == len(plain) == 2
    for key in ("loss", "grad_norm", "reward", "entropy"):
        assert float(sp[0][key]) == pytest.approx(float(plain[0][key]), rel=1e-5, abs=1e-7), key
    assert float(sp[0]["grad_norm"]) > 0 and all(math.isfinite(float(row["loss"])) for row in sp)
    # completions/mean_length counts each completion once (TRL gathers the lengths inside the split generation)
    assert sp[0]["completions/mean_length"] == plain[0]["completions/mean_length"]


def test_cpu_ulysses2_grpo_steps_equal_data_parallel(data_parallel, tmp_path):
    """2 GRPO steps through launch/train.py with cpu_ulysses2.yaml: SP = 2, ZeRO-2, offload, checkpointing, 4 rows per
    SP group, both processes holding each row's halves (the run stops if a group's ranks ever hold different rows).
    The data-parallel equivalent is cpu_zero2.yaml with 2 rows per process: the same 4 prompts, the same completions
    (each rank of the group generates the half a data-parallel rank would, from the same seed), so the first step
    logs the same loss, grad norm, reward and entropy (measured equal to the printed digits), through the real ZeRO-2
    engine: the SP gradient is not scaled twice. From the second step the completions differ: a data-parallel rank's
    RNG also carries the step's other draws (TRL's shuffle), an SP rank's generation stream only its own sampling."""
    sp, stdout = launch("cpu_ulysses2", tmp_path)
    assert "sequence parallelism: Ulysses over 2 processes (each group of 2 shares its rows" in stdout
    assert_first_step_equal(sp, data_parallel())


@pytest.mark.parametrize("engine", ["zero3", "ddp"])
def test_sp_under_zero3_and_ddp_equals_data_parallel(engine, data_parallel, tmp_path):
    """SP x ZeRO-3 and SP x DDP: the same SP = 2 run as cpu_ulysses2 (cpu_zero2's training side with
    --sequence_parallel_size 2) under cpu_zero3.yaml (partitioned weights gathered for the shards' forward and the
    tiled re-run) and under plain torch DDP (test_ddp.py's YAML; DDP averages over both ranks as ZeRO does), against
    the data-parallel run of the same preset: step 1's loss, grad norm, reward and entropy equal."""
    from support.launch import DDP_YAML

    config = None
    if engine == "ddp":
        config = tmp_path / "cpu_ddp.yaml"
        config.write_text(DDP_YAML)
    preset = "cpu_zero3" if engine == "zero3" else "cpu_zero2"
    sp, stdout = launch(preset, tmp_path, "--preset", preset, "--sequence_parallel_size", "2",
                        config=None if config is None else str(config))
    assert "sequence parallelism: Ulysses over 2 processes (each group of 2 shares its rows" in stdout
    assert "activation offload: on" in stdout
    assert_first_step_equal(sp, data_parallel(preset))


def test_group_shared_sampler_deals_each_batch_to_one_group():
    """accelerate's sharding of GroupSharedSampler over 4 processes with SP = 2: ranks 0-1 and 2-3 draw the same
    batches, and the two groups draw what 2 data-parallel processes draw from TRL's sampler."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler
    from trl.trainer.utils import RepeatSampler

    from grpo_accel.parallel.sequence_parallel import GroupSharedSampler

    def base():  # each process builds its own, seeded alike (as TRL's processes do)
        return RepeatSampler(list(range(40)), mini_repeat_count=4, batch_size=4, repeat_count=2, shuffle=True, seed=3)

    rows = 8  # one group's dataloader batch

    def dealt(sampler, processes):
        return [list(BatchSamplerShard(BatchSampler(sampler(), rows, False), num_processes=processes,
                                       process_index=p)) for p in range(processes)]

    sp = dealt(lambda: GroupSharedSampler(base(), rows, 2), 4)
    dp = dealt(base, 2)
    assert sp[0] == sp[1] == dp[0] and sp[2] == sp[3] == dp[1] and dp[0] != dp[1] and len(dp[0]) == 20
    assert len(GroupSharedSampler(base(), rows, 2)) == 2 * len(base())


def test_sp_group_batch_is_checked_when_the_config_is_made(tmp_path, monkeypatch):
    """Under SP an SP group is one data-parallel rank: TRL's generation batch counts world/sp ranks, and one group's
    batch must split over its processes and hold whole groups of num_generations; else one line names the fix.
    (The method reads WORLD_SIZE as a launch sets it; called directly so no process group is needed.)"""
    from grpo_accel.core.errors import ConfigError
    from grpo_accel.trainer.config import GRPOAccelConfig

    cfg = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=4,
                          gradient_accumulation_steps=2, sequence_parallel_size=2, report_to="none", use_cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg._share_batches_over_sp_groups()
    assert cfg.generation_batch_size == 8  # 2 rows x 2 steps per group, 2 groups (not 4 processes' 16)
    cfg.steps_per_generation = 1  # 2 rows per group: half a group of 4 generations
    with pytest.raises(ConfigError, match=r"generates 2 completions .* Fix: --gradient_accumulation_steps 2 "):
        cfg._share_batches_over_sp_groups()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"--sequence_parallel_size 2 must divide the 3 processes"):
        cfg._share_batches_over_sp_groups()


def test_accelerates_own_sp_is_refused_when_the_config_is_made(tmp_path):
    """accelerate's ParallelismConfig(sp_size=N) hands DeepSpeed its SP group, and ZeRO then divides gradients by
    world/N, summing each SP group's shard gradients (deepspeed/runtime/zero/stage_1_and_2.py); our SP already scales
    each rank's slice by N for an engine that averages over the world (test_cpu_ulysses2_grpo_steps_equal_data_parallel:
    SP=2 under real ZeRO-2 logs the data-parallel run's grad norm), so the two together would scale by N twice, and
    accelerate's loader adapter cuts batches along the sequence, which GRPO's prompt batches are not. One line names
    the flag that does it."""
    from accelerate.parallelism_config import ParallelismConfig

    from grpo_accel.core.errors import ConfigError
    from grpo_accel.trainer.config import GRPOAccelConfig

    with pytest.raises(ConfigError, match=r"parallelism_config sp_size=2: .* Fix: .*--sequence_parallel_size 2\.$"):
        GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
                        use_cpu=True, parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))


def test_sp_group_samples_like_single_processes(tmp_path):
    """generate_once over an SP group of 2: each rank samples its half of the group's prompts from its own random
    stream (seeded as TRL seeds a process), as one process with that seed would; the group's other random draws stay
    equal on both ranks. Before the fix every rank left generation with the leader's RNG state, so from step 2 on
    both ranks sampled the same completions for their copies of a prompt."""
    out = tmp_path / "gen.pt"
    cmd = [sys.executable, os.path.join(WORKERS, "sp_generation_worker.py"), "--out", str(out),
           "--port", str(free_port())]
    result = run_process_group(cmd, 300, cwd=ROOT, env=child_env())
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(f"{out}.rank{rank}") for rank in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # every rank holds the group's completions
    for step, completions in enumerate(ranks[0]["steps"]):
        assert completions[:2] == ranks[0]["reference"][step], step
        assert completions[2:] == ranks[1]["reference"][step], step
        assert completions[:2] != completions[2:], step
        assert torch.equal(ranks[0]["after"][step], ranks[1]["after"][step]), step


@pytest.mark.parametrize("option, match", [
    (dict(logprob_mini_batch=2), r"^--logprob_mini_batch 2 does not apply under --sequence_parallel_size 2: .* Fix: "
                                 r"leave --logprob_mini_batch unset"),
    (dict(logprob_token_budget=64), r"^--logprob_token_budget 64 does not apply .* Fix: leave --logprob_token_budget"),
    (dict(use_vllm=True, vllm_mode="colocate"), r"^--sequence_parallel_size 2 with colocated vLLM is not supported "
                                                r"\(untested\)\. Fix: --vllm_mode server"),
], ids=["mini_batch", "token_budget", "colocated_vllm"])
def test_what_sp_does_not_run_is_refused_when_the_config_is_made(tmp_path, monkeypatch, option, match):
    """SP x mini-batch and SP x colocated vLLM (docs/pairs.md): each SP pass is one forward split along the rows'
    length, so a rows/tokens cap per forward would be dropped; colocated engines under SP have never been run. Both
    are refused with one line when the config is made on a multi-process launch; one process (SP off) keeps them.
    (The check reads WORLD_SIZE as a launch sets it; called directly so no process group is needed.)"""
    from grpo_accel.core.errors import ConfigError
    from grpo_accel.trainer.config import GRPOAccelConfig

    cfg = GRPOAccelConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          report_to="none", use_cpu=True, sequence_parallel_size=2, **option)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=match):
        cfg._refuse_what_sp_does_not_run()
    cfg.logprob_mini_batch = cfg.logprob_token_budget = None
    cfg.vllm_mode = "server"
    cfg._refuse_what_sp_does_not_run()  # the preset's way (a vLLM server, no caps) passes
    monkeypatch.setattr(cfg, "sequence_parallel_size", 1)
    for name, value in option.items():
        setattr(cfg, name, value)
    cfg._refuse_what_sp_does_not_run()  # SP off: nothing refused


def test_sp_with_trls_head_is_refused():
    """SP x logprob_impl trl (docs/pairs.md): the SP pass runs inside our log-prob head (SequenceParallel wraps
    it), so TRL's own head would leave SP off unsaid. Refused before any process group is needed, with one line."""
    from grpo_accel.core.errors import ConfigError
    from grpo_accel.parallel import sequence_parallel

    with pytest.raises(ConfigError, match=r"^--sequence_parallel_size 2 needs grpo_accel's log-prob head\. Fix: "
                                          r"--logprob_impl auto\.$"):
        sequence_parallel.enable(2, models=[], logprob_impl="trl")
