"""benchmarks/bench_rollout_budget.py's runs are commands launch/train.py accepts, each the configuration its name
says (the script's measured run takes ~30 min on 2 cores: docs/measurements.md quotes it; this checks what it
launches in a second, without a launch)."""

from pathlib import Path

import pytest

from grpo_accel.app.run_spec import resolve_run_spec
from grpo_accel.generation.continuous_batching import ROUND_PAGE_SIZE

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout_budget.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_rollout_budget

    return bench_rollout_budget


def test_each_variant_is_the_run_its_name_says(bench, tmp_path):
    args = bench.parse_args([])
    want = {"budget_off": (0, 1), "budget_off_page16": (0, 1), "trl_steps_per_generation_2": (0, 2),
            "budget_16": (16, 1), "vllm_budget_off": (0, 1), "vllm_budget_16": (16, 1)}
    assert set(bench.IMPLS) == set(want)
    for impl, (budget, steps_per_generation) in want.items():
        cmd = bench.command(impl, 3, args, tmp_path / impl)
        config = resolve_run_spec(cmd[2:]).config
        assert (config.rollout_budget, config.steps_per_generation) == (budget, steps_per_generation), impl
        pages = (config.transformers_continuous_batching_config or {}).get("page_size")
        assert pages == (ROUND_PAGE_SIZE if impl == "budget_off_page16" else None), impl  # the budget's own pages
        # the same run otherwise: route, lengths, batch, seed
        vllm = impl.startswith("vllm_")
        assert config.use_vllm == vllm and config.use_transformers_continuous_batching == (not vllm), impl
        assert (cmd[0] == str(bench.VLLM_PYTHON)) == vllm, impl
        assert (config.max_completion_length, config.num_generations, config.per_device_train_batch_size,
                config.seed) == (args.completion_length, 4, 4 * args.prompts, 3)
