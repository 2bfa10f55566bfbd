"""A few GRPOAccelTrainer steps in a fresh process (one engine per process); prints one JSON line of measurements.

    python tests/vllm_engine/grpo_run.py MODE [--steps N]

MODE: shared    LoRA, use_vllm=True (the model passed as a directory: the engine loads it, the trainer gets views)
      unshared  LoRA, use_vllm=True, vllm_share_weights=False (the engine keeps its own copy, as TRL does)
      full      full fine-tuning, use_vllm=True (own copy; every weight pushed after each optimizer step)
      hf        LoRA, use_vllm=False: the training footprint without an engine (HF generate())
Savers on top (any mode): --offload-tokens N (gradient checkpointing + activation offload, re-run in pieces of
N tokens: sequence tiles when N is shorter than a row; set GRPO_ACCEL_OFFLOAD_FORCE_COPIES=1 for the real copy
path on CPU), --token-budget N (packed log-prob forwards of <= N tokens: several per backward), --mini-batch N
(N padded rows per log-prob forward, padding_free off). --rollout-budget N: decode rounds of N tokens, unfinished
completions carried into the next step (the tokens 1000-10999 stop a completion too, so lengths vary).
--top-p P / --top-k K: truncated sampling (the engine reports the truncated distribution's log-probs);
--uncorrected: with the trainer's kept-mass correction taken out (truncated_sampling.kept_mass_correction -> None);
--is-mode: TRL's vllm_importance_sampling_mode (default sequence_mask); --dynamic-sampling: with
tests/support/rewards.half_flat_reward (groups of 4 whose rewards are all equal on prompts with an even answer), so
some batches need refill rounds.
--dtype fp16: with --cuda only; --quantization 4bit (QLoRA,
the engine's own NF4 copy through vllm-bnb-plugin): bf16 compute on CPU, --dtype on CUDA.
Used by the tests through conftest.grpo_run and by benchmarks/bench_vllm_memory.py. Peak memory is the process's VmHWM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time

import torch

FIXED = "Question: what is 17 + 25? Think step by step, then answer.\nAnswer: 17 + 25 = 42. The answer is 42."


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reward_digits(completions, **kwargs):
    """Any reward with spread, so every step has a non-zero gradient and moves the weights."""
    return [float(sum(ch.isdigit() for ch in c[0]["content"]) % 4) + 0.1 * (len(c[0]["content"]) % 5)
            for c in completions]


def count_saver_work() -> dict[str, int]:
    """Counters proving each saver ran: host copies of the offload stash (out and back), sequence-tiled re-runs,
    log-prob forwards with grad and backwards (several forwards per backward = mini-batches)."""
    from grpo_accel.offload import stash
    from grpo_accel.tiling import layer as tiled

    counts = {"offload_copies": 0, "tiled_backwards": 0, "grad_forwards": 0, "backwards": 0}

    def counted(fn, key):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return wrapper

    stash._copy = counted(stash._copy, "offload_copies")
    tiled.backward = counted(tiled.backward, "tiled_backwards")
    return counts


def count_forwards(trainer, counts: dict[str, int]) -> None:
    def pre_hook(module, args):
        if torch.is_grad_enabled() and module.training:
            counts["grad_forwards"] += 1

    trainer.accelerator.unwrap_model(trainer.model).register_forward_pre_hook(pre_hook)
    backward = trainer.accelerator.backward

    def counted_backward(*a, **k):
        counts["backwards"] += 1
        return backward(*a, **k)

    trainer.accelerator.backward = counted_backward


def record_handed(trainer) -> tuple[list[dict], list[int]]:
    """Per trained batch (--rollout-budget): what TRL was handed against the rollout records it came from — tokens
    and behaviour log-probs equal, none NaN — and how many tokens an older policy version sampled; and the step of
    each adapter push to the engine."""
    from grpo_accel.trainer.carried_rollouts import BudgetMode

    mode = trainer.generation_mode
    assert isinstance(mode, BudgetMode)
    seen, synced, real = [], [], mode.single_turn

    def handed(tr, prompt_ids):
        got = real(tr, prompt_ids)
        if got is not None and mode.carried is not None:
            version, ready = mode.carried
            records = [r for g in ready for r in g.rollouts]
            seen.append({"version": version, "same_tokens": got[0] == [r.completion_ids for r in records],
                         "same_logps": got[1] == [r.behaviour_logps for r in records],
                         "nan_logps": sum(math.isnan(x) for seq in got[1] for x in seq),
                         "older_tokens": sum(v < version for r in records for v in r.versions),
                         "tokens": sum(len(r.completion_ids) for r in records)})
        return got

    mode.single_turn = handed  # this mode object's own, for this run
    sync = trainer.vllm_generation.sync_weights

    def counted_sync():  # the global step each adapter push happened at
        synced.append(trainer.state.global_step)
        return sync()

    trainer.vllm_generation.sync_weights = counted_sync
    return seen, synced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["shared", "unshared", "full", "hf"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("GRPO_ACCEL_VLLM_THREADS", "1")))
    ap.add_argument("--completion", type=int, default=24)
    ap.add_argument("--cuda", action="store_true", help="train and generate on the GPU (bf16 engine and model)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="--cuda: weights and autocast dtype")
    ap.add_argument("--quantization", choices=["none", "4bit"], default="none",
                    help="LoRA: a 4-bit (QLoRA) model; the engine quantizes its own copy in flight")
    ap.add_argument("--offload-tokens", type=int, default=0)
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--mini-batch", type=int, default=None)
    ap.add_argument("--rollout-budget", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--uncorrected", action="store_true")
    ap.add_argument("--is-mode", default="sequence_mask", help="TRL's vllm_importance_sampling_mode")
    ap.add_argument("--dynamic-sampling", action="store_true")
    ap.add_argument("--model", default=None, help="a saved model directory (default: the embedded SmolLM2)")
    args = ap.parse_args()
    if args.dtype != "bf16" and not args.cuda:
        ap.error("--dtype fp16 needs --cuda")
    torch.set_num_threads(args.threads)

    from peft import LoraConfig

    from grpo_accel.data.datasets import train_eval_datasets
    from grpo_accel.data.models import embedded_model_dir, load_tokenizer
    from grpo_accel.generation import vllm_colocate as vc
    from grpo_accel.trainer.config import GRPOAccelConfig
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    model_dir = args.model or str(embedded_model_dir())
    tokenizer = load_tokenizer(model_dir)
    half = "float16" if args.dtype == "fp16" else "bfloat16"
    model = model_dir
    if args.quantization == "4bit":  # loaded here: the engine starts beside it and quantizes its own copy
        from grpo_accel.data.models import load_model

        # bf16 compute on CPU too: vllm-bnb-plugin 0.0.3 cannot load an fp32 engine (vllm_setup refuses it)
        model, _ = load_model(model_dir, dtype=half, quantization="4bit")
    train, _ = train_eval_datasets("arithmetic", 16, 0, level=1, seed=0)
    reward = reward_digits
    if args.dynamic_sampling:
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.rewards
        from support.rewards import half_flat_reward as reward
    if args.uncorrected:
        import grpo_accel.trainer.trainer as trainer_module

        trainer_module.kept_mass_correction = lambda trainer: None
    lora = None if args.mode == "full" else LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config = GRPOAccelConfig(
        output_dir=os.environ.get("GRPO_RUN_OUT", "/tmp/grpo_run"), use_cpu=not args.cuda, report_to=[],
        bf16=args.cuda and args.dtype == "bf16", fp16=args.cuda and args.dtype == "fp16",
        use_vllm=args.mode != "hf", vllm_mode="colocate", vllm_share_weights=args.mode != "unshared",
        per_device_train_batch_size=8, num_generations=4, max_completion_length=args.completion,
        max_steps=args.steps, logging_steps=1, top_p=args.top_p, top_k=args.top_k,
        dynamic_sampling=args.dynamic_sampling,
        learning_rate=5e-5 if args.mode == "full" else 2e-3,
        save_strategy="no", gradient_checkpointing=bool(args.offload_tokens), temperature=0.7, seed=0,
        offload_activations="true" if args.offload_tokens else "false",
        offload_recompute_tokens=args.offload_tokens or 16384, logprob_token_budget=args.token_budget,
        logprob_mini_batch=args.mini_batch, padding_free=args.mini_batch is None,
        model_init_kwargs=None if args.quantization == "4bit" else {"dtype": half if args.cuda else "float32"},
        rollout_budget=args.rollout_budget, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=args.is_mode,
        # a random tiny model almost never samples its EOS: 10,000 stop ids end ~20% of tokens' completions
        generation_kwargs={"stop_token_ids": list(range(1000, 11000))} if args.rollout_budget else None)
    counts = count_saver_work()
    t0 = time.perf_counter()
    trainer = GRPOAccelTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                               processing_class=tokenizer, peft_config=lora)
    out = {"mode": args.mode, "threads": args.threads, "cuda": args.cuda, "start_s": time.perf_counter() - t0,
           "rss_after_start": status_bytes("VmRSS"),
           "param_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters())}
    engine = trainer.vllm_engine
    calls, samples = [], []
    if engine is not None:
        out.update(shared=engine.shared, kv_cache_bytes=engine.config.kv_cache_bytes, sleep=engine.config.sleep,
                   memory_fraction=engine.config.memory_fraction,
                   shared_fraction=vc.shared_fraction(trainer.model, engine.llm), refusal=engine.refusal,
                   agreement_bound=engine.agreement.bound if engine.agreement else None)
        original = engine.generate

        def generate(*a, **k):
            outputs = original(*a, **k)
            calls.append(len(a[0]))
            # the completions sampled, so two runs can show they trained on the same samples
            tokens = [list(c.token_ids) for o in outputs for c in o.outputs]
            samples.append(hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16])
            return outputs

        engine.generate = generate
    count_forwards(trainer, counts)
    handed, synced = record_handed(trainer) if args.rollout_budget else ([], [])
    if engine is not None and not args.rollout_budget:
        sync = trainer.vllm_generation.sync_weights

        def counted_sync():  # the global step of each push to the engine
            synced.append(trainer.state.global_step)
            return sync()

        trainer.vllm_generation.sync_weights = counted_sync
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    t0 = time.perf_counter()
    trainer.train()
    out.update(train_s=time.perf_counter() - t0, peak_rss=status_bytes("VmHWM"), engine_generate_calls=calls,
               samples_digest=samples)
    if args.cuda:
        out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    out["moved"] = max((p.detach() - before[n]).abs().max().item()
                       for n, p in trainer.model.named_parameters() if n in before)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out["grad_norms"] = [h.get("grad_norm") for h in logs]
    out["losses"] = [h.get("loss") for h in logs]
    out["share_token_ratios"] = [h.get("share_prompt/token_ratio", 1.0) for h in logs]
    out.update(counts, offload_enabled=trainer.offload_enabled, padding_free=trainer.padding_free)
    out["sampling_logp_difference_max"] = [h.get("sampling/sampling_logp_difference/max") for h in logs]
    out["is_ratio_min"] = [h.get("sampling/importance_sampling_ratio/min") for h in logs]
    out["carried_completions"] = [h.get("rollouts/carried_completions") for h in logs]
    out["rounds"] = [h.get("rollouts/rounds") for h in logs]
    out["is_ratio_mean"] = [h.get("sampling/importance_sampling_ratio/mean") for h in logs]
    out["sampling_rounds"] = [h.get("dynamic_sampling/rounds") for h in logs]
    out["groups_kept"] = [h.get("dynamic_sampling/groups_kept") for h in logs]
    out["kept_mass_correction"] = trainer.kept_mass_correction is not None
    out["synced_at"], out["handed"] = list(synced), handed  # a copy: the engine check below syncs once more
    if engine is not None:
        ids = tokenizer(FIXED)["input_ids"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        reference = vc.hf_token_logprobs(model, ids)
        # how far the trainer's log-probs are from any one value (spread) and from uniform's -log(vocab): the bound
        # on engine_vs_trainer_logprob_maxdiff tells an engine that ignores the weights only when they are far
        out["trainer_logprob_spread"] = (reference.max() - reference.min()).item()
        out["trainer_vs_uniform_logprob_maxdiff"] = (reference + math.log(model.config.vocab_size)).abs().max().item()

        def engine_diff():
            return (engine.prompt_logprobs(ids, use_adapter=engine.has_adapter) - reference).abs().max().item()

        # The engine still has the weights of before the last optimizer step; the sync brings that step over,
        # as it would before the next generation.
        out["stale_logprob_maxdiff"] = engine_diff()
        trainer.vllm_generation.sync_weights()
        out["engine_vs_trainer_logprob_maxdiff"] = engine_diff()
        out["shared_fraction_after"] = vc.shared_fraction(trainer.model, engine.llm)
    print("GRPO_RUN " + json.dumps(out), flush=True)


if __name__ == "__main__":
    from grpo_accel.core.process_exit import exit_without_teardown

    exit_without_teardown(main())  # vLLM's and the stack's teardown is seconds of a core per process
