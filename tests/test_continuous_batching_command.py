"""Route continuous_batching (issue 45) through the user's command, launch/train.py, each check against TRL 1.16's own
GRPOTrainer or the weights as loaded.

    OMP_NUM_THREADS=1 pytest tests/test_continuous_batching_command.py   # 15 s of tests on an idle core (35 s on
                                                                         # a loaded host), + ~10 s of imports

- Parity: LoRA in fp32 (TRL's branch casts the model only in bf16/fp16 runs, so here it is correct), every saver
  the command has on CPU (fused chunked log-prob head, padding-free packing, the shared prompt; activation offload
  forced on), a small page pool passed as a user passes it (`--transformers_continuous_batching_config '{...}'`, a
  JSON string GRPOConfig parses), Adam, 2 steps: the same completions token for token (both trainers' generate_batch
  calls, spied) and every logged figure of each step equal to TRL's own continuous-batching run on the same seed,
  rows and pool (1e-5 relative; tests/test_own_data.py's pattern: resolved_config.json becomes TRL's GRPOConfig).
- QLoRA (a 4-bit NF4 base, LoRA adapters that TRL's init stores in bf16): TRL's branch does not refuse the 4-bit
  model (PeftModel.to casts floating-point tensors only; the NF4 bytes are uint8) but casts in place, for good, what
  its half dtype does not match: in an fp16 run (t4_qlora's dtypes) the bf16 adapter becomes fp16; in a bf16 run
  over an fp32-loaded base, the embeddings and norms become bf16 (shown on its own trainer). Ours, through the
  command in the fp16 case: generates with the paged path (generate_batch on the trained model, 8 prompts a step,
  the route line), trains, and after 2 steps the adapter has its dtype and new values, the NF4 weights, their
  absmax and the fp16 embeddings and norms are byte for byte a fresh 4-bit load of the same directory.
- The pool as a user sets it: a JSON object on the command line or a mapping in --config's YAML reaches the config as
  the same dict; a string that is not a JSON object, or a key ContinuousBatchingConfig lacks, is one `error:` line
  naming the fix, exit 2, before any weights load (TRL's trainer read it only after loading, then a traceback).

Runs call launch/train.py's `main` in this process (support.launch.train), one run per check.
"""

import json

import datasets
import pytest
import torch
from peft import LoraConfig
from support.launch import assert_user_error
from support.rewards import length_reward
from support.trainers import saved_tiny_model
from test_own_data import assert_same_steps, chat, launch, trl_steps, write_jsonl
from transformers.generation.continuous_batching.continuous_api import ContinuousMixin
from trl import GRPOConfig, GRPOTrainer

from grpo_accel.data.datasets import arithmetic_dataset
from grpo_accel.data.models import load_model

# TRL sizes the pool from a fraction of free memory unless told (36 s on CPU); both trainers get this one. Block
# sharing off: ours then submits each prompt copy as TRL's branch does (with it, a group forks from one prefill and
# draws other random numbers), so the same seed gives the same completions.
POOL = {"num_blocks": 16, "page_size": 32, "max_batch_tokens": 64, "allow_block_sharing": False}
CB_ARGS = ["--use_transformers_continuous_batching", "true", "--transformers_continuous_batching_config",
           json.dumps(POOL), "--rewards", "support.rewards:length_reward"]
ROUTE_LINE = "generation route continuous_batching:"


def _prompt_ids(trainer) -> list[list[int]]:
    """The token ids of the first 2 prompts, 4 copies each, as TRL's sampler lays a batch of 8 side by side."""
    tok = trainer.processing_class
    return [list(tok.apply_chat_template(trainer.train_dataset[i // 4]["prompt"], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for i in range(8)]


@pytest.fixture
def paged_calls(monkeypatch):
    """Every generate_batch call (transformers' continuous batching), whoever makes it: the model it ran on, how many
    prompts, the completions' token ids and the trainable weights as the call found them."""
    calls, real = [], ContinuousMixin.generate_batch

    def spy(self, inputs, *args, **kwargs):
        trainable = {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}
        out = real(self, inputs, *args, **kwargs)
        calls.append({"model": self, "prompts": len(inputs), "trainable": trainable,
                      "completions": [list(o.generated_tokens) for o in out.values()]})
        return out

    monkeypatch.setattr(ContinuousMixin, "generate_batch", spy)
    return calls


def test_every_saver_two_steps_equal_trl_continuous_batching(tmp_path, capsys, paged_calls):
    """fp32 LoRA, every saver on, 2 Adam steps through the command vs TRL's GRPOTrainer with
    use_transformers_continuous_batching and the same pool: the same completions, rewards, loss and every other
    logged figure. The loss itself is ~1e-7 (the first iteration's ratio is 1: the mean advantage), so the gradient
    is compared through grad_norm. Adam, not SGD as the in-process test: each step's figures are computed before its
    own update, so only step 2's sit on one Adam update (lr x sign(grad) where rounding could flip a tiny gradient's
    sign); they agree to 1e-5 and step 2's completions token for token (measured), so the comparison keeps the
    command's default optimizer."""
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [{"prompt": chat(i)} for i in range(16)])
    out = tmp_path / "run"
    ours, logged = launch([*CB_ARGS, "--dataset", str(data), "--train_size", "16", "--offload_activations", "true"],
                          out, capsys)
    assert ROUTE_LINE in logged, logged[-3000:]
    assert "padding_free: log-prob passes run on packed rows" in logged and "share_prompt=auto: the log-prob" in logged
    assert "log-prob head: chunked; activation offload: on" in logged, logged[-3000:]
    assert "continuous batching: page pool 16 pages x 32 tokens" in logged  # the pool as given, not planned
    resolved = json.loads((out / "resolved_config.json").read_text())["config"]
    assert resolved["transformers_continuous_batching_config"] == POOL and not resolved["bf16"]
    assert resolved["optim"].startswith("adamw") and float(ours[0]["reward_std"]) > 0  # a non-trivial loss
    ours_generated = [c["completions"] for c in paged_calls]
    assert [c["prompts"] for c in paged_calls] == [8, 8]  # each step's 8 rows, one copy per completion

    paged_calls.clear()
    trl = trl_steps(out, [length_reward], datasets.load_dataset("json", data_files=str(data), split="train"))
    assert [c["completions"] for c in paged_calls] == ours_generated  # TRL's branch, token for token
    assert_same_steps(ours, trl)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-llama saved (a model built in code refuses 4-bit loading), as tests/test_qlora.py does."""
    return saved_tiny_model(tmp_path_factory.mktemp("tiny-llama-saved"))


@pytest.mark.parametrize("half, loaded, cast", [("fp16", torch.float16, "adapter"), ("bf16", torch.float32, "base")])
def test_trl_branch_casts_a_qlora_model_in_place(model_dir, half, loaded, cast):
    """TRL's own trainer, NF4 base loaded with `loaded` non-quantized weights, LoRA, a `half` run, one call of its
    continuous-batching generation: no error, the NF4 bytes untouched, and every floating-point weight of another
    dtype cast to `half` in place (fp16: the bf16 adapter, whose updates then round to fp16; bf16: the fp32 base)."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model, tok = load_model(model_dir, quantization="4bit", dtype=loaded)
    args = GRPOConfig(output_dir="/tmp/grpo_accel_cb_qlora", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, report_to="none", seed=0, max_steps=1, use_cpu=True, beta=0.0,
                      use_transformers_continuous_batching=True, transformers_continuous_batching_config=dict(POOL),
                      **{half: True})
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tok,
                          train_dataset=arithmetic_dataset("train", 8),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert {p.dtype for n, p in before.items() if "lora_" in n} == {torch.bfloat16}  # TRL's QLoRA init
    trainer._generate_single_turn(_prompt_ids(trainer), None, {}, 4)
    after = dict(trainer.model.named_parameters())
    target = {"fp16": torch.float16, "bf16": torch.bfloat16}[half]
    nf4 = [n for n, p in before.items() if p.dtype == torch.uint8]
    assert len(nf4) == 14 and all(torch.equal(after[n], before[n]) for n in nf4)
    changed = {n for n in before if after[n].dtype != before[n].dtype}
    assert changed and all(after[n].dtype == target for n in changed)
    assert changed == {n for n, p in before.items() if p.dtype not in (torch.uint8, target)}
    assert all(("lora_" in n) == (cast == "adapter") for n in changed), sorted(changed)


def test_qlora_generates_paged_and_trains_with_weights_untouched(model_dir, tmp_path, capsys, paged_calls):
    """The fp16 QLoRA run whose adapter TRL's branch casts, through the command: both steps generated by
    generate_batch on the trained model; after them the adapter is bf16 as TRL's init stored it, and moved; the
    frozen base (NF4 bytes, their absmax, fp16 embeddings and norms) equals a fresh 4-bit load, byte for byte."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    _, logged = launch([*CB_ARGS, "--model", model_dir, "--quantization", "4bit", "--model_dtype", "fp16",
                        "--fp16", "true", "--use_cpu", "true", "--eval_size", "0"], out, capsys)
    assert ROUTE_LINE in logged, logged[-3000:]
    assert [c["prompts"] for c in paged_calls] == [8, 8] and len({id(c["model"]) for c in paged_calls}) == 1
    model = paged_calls[0]["model"]
    adapter = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapter) == 28 and all("lora_" in n for n in adapter)  # A, B x 7 linears x 2 layers
    assert {p.dtype for p in adapter.values()} == {torch.bfloat16}
    first = paged_calls[0]["trainable"]  # as step 1's generation found it, before any update
    assert first.keys() == adapter.keys() and {p.dtype for p in first.values()} == {torch.bfloat16}
    assert any(not torch.equal(first[n], adapter[n]) for n in adapter)  # trained

    fresh, _ = load_model(model_dir, quantization="4bit", dtype=torch.float16)
    fresh = dict(fresh.named_parameters())
    base = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if not p.requires_grad}
    assert base.keys() == fresh.keys()
    for name, p in base.items():
        assert p.dtype == fresh[name].dtype and torch.equal(p.data, fresh[name].data), name
        if p.dtype == torch.uint8:
            assert torch.equal(p.quant_state.absmax, fresh[name].quant_state.absmax), name
    assert {p.dtype for p in base.values()} == {torch.uint8, torch.float16}


def test_the_pool_by_flag_or_yaml_and_bad_values_refused_before_loading(tmp_path, capsys):
    """The same dict by flag and by --config YAML; each malformed value: exit 2, one `error:` line, nothing written."""
    from grpo_accel.app.run_spec import resolve_run_spec

    yaml = tmp_path / "run.yaml"
    yaml.write_text("transformers_continuous_batching_config:\n" + "".join(f"  {k}: {json.dumps(v)}\n"
                                                                          for k, v in POOL.items()))
    base = ["--model", "tiny-llama", "--output_dir", str(tmp_path / "spec")]
    by_flag = resolve_run_spec([*base, *CB_ARGS]).config.transformers_continuous_batching_config
    by_yaml = resolve_run_spec([*base, "--config", str(yaml)]).config.transformers_continuous_batching_config
    assert by_flag == by_yaml == POOL
    out = tmp_path / "run"
    flag = "--transformers_continuous_batching_config"
    for value, pattern in [
        ("num_blocks=16", r"'num_blocks=16' is not a JSON object of ContinuousBatchingConfig's arguments\. Fix: "
                          r"--transformers_continuous_batching_config '\{\"num_blocks\": 16"),
        ("{num_blocks: 16}", r"is not valid JSON \(Expecting property name enclosed in double quotes at character 1\)"),
        ('{"num_block": 16}', r"'num_block' is not an argument of transformers' ContinuousBatchingConfig; did you "
                              r"mean 'num_blocks'\? Fix"),
    ]:
        assert_user_error(["--model", "tiny-llama", "--use_transformers_continuous_batching", "true", flag, value,
                           "--output_dir", str(out)], pattern, capsys, out)
