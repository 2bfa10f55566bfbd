"""The body of launch/train.py: validate, load, evaluate, train, evaluate, write the run's artifacts.

Everything that can be checked before loading weights is checked first, so bad input fails in a
second with a message that names the fix, and no run directory is created for a run that never started.
"""

from __future__ import annotations

import os
import time

import torch

from grpo_accel.app import bitsandbytes_gate
from grpo_accel.app.report import plot_reward_curve, step_rows, write_json, write_metrics_csv
from grpo_accel.core import dtypes
from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError, UserError, run_guarded
from grpo_accel.core.processes import (
    launched_processes,
    local_processes,
    local_rank,
    process_rank,
    several_processes,
)
from grpo_accel.core.units import GIB
from grpo_accel.data.datasets import load_run_data, prompt_lengths
from grpo_accel.data.models import ModelLoadError, load_model, load_tokenizer
from grpo_accel.data.rewards import (
    RewardModelRef,
    check_reward_weights,
    load_reward_model,
    resolve_rewards,
    reward_names,
)
from grpo_accel.trainer.checkpoints import latest_complete_checkpoint


def configure_tracking(config) -> None:
    """wandb runs offline when no API key is configured; its files go under the run directory."""
    if "wandb" not in (config.report_to or []):
        return
    has_key = os.environ.get("WANDB_API_KEY") or _netrc_has_wandb()
    if not has_key and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"
        log("wandb: no API key configured, logging offline (sync later with `wandb sync`)")
    os.environ.setdefault("WANDB_DIR", config.output_dir)
    os.environ.setdefault("WANDB_PROJECT", "grpo_accel")


def _netrc_has_wandb() -> bool:
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def check_output_dir(path: str) -> None:
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"output directory {path!r} is not writable (checked {parent}). Fix: pass a "
                          f"writable --output_dir.")


RUN_MARKERS = ("resolved_config.json", "metrics.csv", "summary.json", "final")


def holds_a_run(path: str) -> bool:
    """A directory an earlier run wrote into: its resolved config, artifacts or checkpoints."""
    if not os.path.isdir(path):
        return False
    return any(n in RUN_MARKERS or n.startswith("checkpoint-") for n in os.listdir(path))


def check_run_dir(path: str, resume, overwrite: bool) -> None:
    """A new run into a directory that holds one would mix its checkpoints with the old run's, and a later
    `--resume_from_checkpoint latest` would resume the wrong one: refuse, naming the three ways out."""
    if resume or overwrite or not holds_a_run(path):
        return
    raise ConfigError(f"{path} already holds a run. Fix: --resume_from_checkpoint latest to continue it, a new "
                      f"--run_name (or --output_dir), or --overwrite_output_dir true to replace it.")


def clear_run_dir(path: str) -> None:
    """--overwrite_output_dir: remove the earlier run's files (only what a run writes, never other files)."""
    import shutil

    for name in os.listdir(path):
        if name in RUN_MARKERS or name.startswith(("checkpoint-", "heldout_", "reward_curve", "wandb")):
            target = os.path.join(path, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    log(f"--overwrite_output_dir: removed the earlier run in {path}")


def settle_lora_alpha(script_args) -> None:
    """--lora_r N on a full fine-tuning preset keeps that preset's lora_alpha of 0, and alpha 0 scales the adapter
    to nothing: zero gradients, a run that silently never learns. Take the usual alpha = 2 x r instead."""
    if script_args.lora_r > 0 and script_args.lora_alpha <= 0:
        given, script_args.lora_alpha = script_args.lora_alpha, 2 * script_args.lora_r
        log(f"lora_alpha {given} with lora_r {script_args.lora_r} would scale the adapter to nothing (a full "
            f"fine-tuning preset's alpha?): using lora_alpha {script_args.lora_alpha}")


def lora_config(script_args):
    if script_args.lora_r <= 0:
        return None
    from peft import LoraConfig

    targets = script_args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    return LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=0.0,
                      target_modules=targets, task_type="CAUSAL_LM")


def check_lora_targets(model, script_args) -> None:
    """PEFT's own error lists nothing useful; name the modules the model does have."""
    if script_args.lora_r <= 0 or script_args.lora_target_modules == "all-linear":
        return
    wanted = {t.strip() for t in script_args.lora_target_modules.split(",")}
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(wanted - linear)
    if missing:
        raise ModelLoadError(f"LoRA target modules {missing} are not in {script_args.model}. Fix: "
                             f"--lora_target_modules "
                             f"with some of {sorted(linear - {'lm_head'})}, or all-linear.")


def _evaluate(trainer, tokenizer, data, script_args, tag):
    """Greedy completions of the held-out prompts: accuracy on question/answer rows, else their mean reward as the
    run's rewards score them in training (weighted; a row no reward applies to is left out of the mean)."""
    from grpo_accel.core.model_access import zero3_gather_ctx
    from grpo_accel.data.evaluate import evaluate, generate_greedy

    t0, model, held_out = time.time(), trainer.model, data.held_out
    kwargs = dict(max_new_tokens=script_args.eval_max_new_tokens, batch_size=script_args.eval_batch_size,
                  desc=f"held-out eval ({tag})", disable_progress=process_rank() != 0)
    # Under ZeRO-3 every rank holds a shard: gather the whole model for generate() (costs one full copy of the
    # weights per rank while evaluating; every rank decodes the same greedy sequences, so they stay in step).
    with zero3_gather_ctx(*model.parameters()):
        if data.kind == "qa":
            result, records = evaluate(model, tokenizer, held_out, **kwargs)
        else:
            rows = list(held_out)
            texts = generate_greedy(model, tokenizer, [r["prompt"] for r in rows], **kwargs)
    if data.kind == "qa":
        log(f"held-out accuracy {tag}: strict {result['accuracy_strict']:.1%}, lenient "
            f"{result['accuracy_lenient']:.1%} ({len(records)} problems, {time.time() - t0:.0f} s)")
        return result, records
    scores = trainer.score_completions(rows, texts)
    scored = [x for x in scores if x == x]  # NaN: no reward applies to that row
    result = {"reward_mean": sum(scored) / len(scored) if scored else float("nan"), "rows_scored": len(scored)}
    log(f"held-out reward {tag}: mean {result['reward_mean']:.4g} over {len(scored)} of {len(rows)} prompts "
        f"(greedy, {time.time() - t0:.0f} s)")
    records = [{"prompt": r["prompt"], "completion": t, "reward": x} for r, t, x in zip(rows, texts, scores)]
    return result, records


def load_training_model(spec, tokenizer, longest_prompt: int):
    """(model, colocated engine or None). With colocated vLLM and a bf16/fp32 model the engine loads the checkpoint
    and the training model is built around its weights, so no second copy exists even while loading."""
    from grpo_accel.generation.vllm_setup import colocated_route, start_colocated_engine

    script, config = spec.script, spec.config
    init_kwargs = {k: v for k, v in (config.model_init_kwargs or {}).items() if k not in ("dtype", "device_map")}
    # the stack the start-up line and the plan used: one decision per run
    action, route = colocated_route(script.model, config, script.quantization, lora_r=script.lora_r,
                                    stack=spec.stack)
    if action == "fallback":  # transformers generates: startup() said which way in its route line
        config.use_vllm = False
        config.use_transformers_continuous_batching = route.startswith("generation route continuous_batching:")
    if action == "from_path":
        from grpo_accel.app.startup_checks import check_memory

        gpu_bytes, host_bytes = machine_memory()
        engine, model = start_colocated_engine(script.model, config, peft_config=lora_config(script),
                                               longest_prompt=longest_prompt, route=route,
                                               dtype=dtypes.torch_dtype(script.model_dtype),
                                               fits_unshared=lambda: check_memory(spec, gpu_bytes, host_bytes,
                                                                                  generation="vllm_copy"))
        return model, engine
    # Otherwise (no vLLM, a 4-bit or tiny model) the trainer starts an unshared engine or says why it cannot.
    model, _ = load_model(script.model, dtype=script.model_dtype, quantization=script.quantization, **init_kwargs)
    return model, None


def train_from_argv(argv: list[str]) -> int:
    """launch/train.py: resolve the run spec from the flags, then run it."""
    from grpo_accel.app.run_spec import resolve_run_spec

    if launched_processes() > 1 and not torch.cuda.is_available():
        from grpo_accel._compat.cpu_distributed import prepare_cpu_processes

        prepare_cpu_processes()
    spec = resolve_run_spec(argv)
    bitsandbytes_gate.check_resolved(spec.script.quantization)
    log(f"preset {spec.preset.name}: {spec.preset_why}")
    return run(spec)


def machine_memory() -> tuple[int | None, int | None]:
    """(GPU bytes, host bytes per process) the plan is checked against; (None, None) without CUDA: nothing to fit."""
    from grpo_accel.app.startup_checks import host_memory_bytes

    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    host_bytes = host_memory_bytes() if gpu_bytes is not None else None
    if host_bytes is not None:  # the plan is per process; the processes of one machine share its memory
        host_bytes //= local_processes()
    return gpu_bytes, host_bytes


def startup(spec, tokenizer, train_ds) -> int:
    """Every check that needs no weights, before any load; returns the longest prompt (it sizes the engine)."""
    from grpo_accel.app.startup_checks import model_config, raise_on_failure, run_checks

    longest = max(prompt_lengths(tokenizer, train_ds["prompt"]))
    gpu_bytes, host_bytes = machine_memory()
    raise_on_failure(run_checks(spec, model_config(spec), longest, gpu_bytes, host_bytes))
    if host_bytes is not None:
        from grpo_accel.core.settings import device_budget_bytes, device_budget_gib
        from grpo_accel.planning.fitting import fit_host

        fitted = fit_host(spec.plan(), host_bytes)
        budget = fitted.inputs["offload_device_budget_bytes"]
        if budget > device_budget_bytes(spec.config.offload_device_budget_gib):  # the host cannot hold them all
            spec.config.offload_device_budget_gib = device_budget_gib(budget)
            log(f"host memory {host_bytes / GIB:.0f} GiB: {budget / GIB:.1f} GiB of layer inputs stay on the GPU")
    route, why = spec.route()
    memory = (f"; memory plan: {spec.plan().peak_gib:.1f} GiB predicted peak per GPU of {gpu_bytes / GIB:.0f} GiB"
              if gpu_bytes is not None else "")
    log(f"generation route {route}: {why}{memory}")
    return longest


def run_inputs(spec):
    """(reward functions, tokenizer, data, longest prompt) of a run, every start-up check passed: what the run needs
    before any weights load."""
    script_args, config = spec.script, spec.config
    reward_funcs = resolve_rewards(script_args.rewards)
    check_reward_weights(config.reward_weights, reward_names(script_args.rewards))
    tokenizer = load_tokenizer(script_args.model)
    if not tokenizer.chat_template:
        raise ModelLoadError(f"the tokenizer of {script_args.model!r} has no chat template. Fix: use an "
                             f"instruct/chat model, or set tokenizer.chat_template in a local copy.")
    data = load_run_data(script_args.dataset, script_args.train_size, script_args.eval_size,
                         level=script_args.dataset_level, seed=config.seed, config=script_args.dataset_config,
                         split=script_args.dataset_split, system_prompt=script_args.system_prompt)
    longest_prompt = startup(spec, tokenizer, data.train)
    log(f"model {script_args.model} ({script_args.model_dtype}), dataset {script_args.dataset}: "
        f"{len(data.train)} train / {len(data.held_out) if data.held_out is not None else 0} held-out prompts")
    if data.note:
        log(data.note)
    return reward_funcs, tokenizer, data, longest_prompt


def run(spec) -> int:
    script_args, config = spec.script, spec.config
    check_output_dir(config.output_dir)
    resume = config.resume_from_checkpoint
    check_run_dir(config.output_dir, resume, script_args.overwrite_output_dir)
    settle_lora_alpha(script_args)
    if resume == "latest":
        resume = latest_complete_checkpoint(config.output_dir)
        if resume is None:
            raise ConfigError(f"no complete checkpoint in {config.output_dir}. Fix: start without "
                              f"--resume_from_checkpoint, or point --output_dir at the run to continue.")
        log(f"resuming from {resume}")
    elif resume and not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise ConfigError(f"{resume} is not a complete checkpoint (no trainer_state.json). Fix: pass "
                          f"--resume_from_checkpoint latest, or another checkpoint-N directory.")
    reward_funcs, tokenizer, data, longest_prompt = run_inputs(spec)
    if script_args.overwrite_output_dir and not resume and holds_a_run(config.output_dir):
        clear_run_dir(config.output_dir)
    configure_tracking(config)
    created = not os.path.isdir(config.output_dir)
    try:
        return _train(spec, tokenizer, data, reward_funcs, resume, longest_prompt)
    except UserError:
        # A run that fails on the user's input before its first checkpoint leaves nothing behind.
        if created and os.path.isdir(config.output_dir) and not any(
                n.startswith("checkpoint-") for n in os.listdir(config.output_dir)):
            import shutil

            shutil.rmtree(config.output_dir, ignore_errors=True)
        raise


def load_rewards(reward_funcs: list, dtype) -> tuple[list, list]:
    """(reward_funcs, reward_processing_classes) for TRL: reward models loaded (in the policy's dtype), each with
    its own tokenizer; functions as they are (None)."""
    funcs, tokenizers = [], []
    for f in reward_funcs:
        model, tok = load_reward_model(f, dtype) if isinstance(f, RewardModelRef) else (f, None)
        funcs.append(model)
        tokenizers.append(tok)
    return funcs, tokenizers


def build_trainer(spec, tokenizer, data, reward_funcs, longest_prompt):
    """The run's GRPOAccelTrainer, its model, rewards and generation route (an engine sized by the plan) as the
    command builds them; also benchmarks/bench_engine_prefill.py's, which measures that engine at full length."""
    from grpo_accel.trainer.trainer import GRPOAccelTrainer

    script_args = spec.script
    model, engine = load_training_model(spec, tokenizer, longest_prompt)
    check_lora_targets(model, script_args)
    reward_funcs, reward_tokenizers = load_rewards(reward_funcs, dtypes.torch_dtype(script_args.model_dtype))
    return GRPOAccelTrainer(model=model, reward_funcs=reward_funcs, args=spec.config, vllm_engine=engine,
                            longest_prompt=longest_prompt, train_dataset=data.train, processing_class=tokenizer,
                            reward_processing_classes=reward_tokenizers, peft_config=lora_config(script_args))


def _train(spec, tokenizer, data, reward_funcs, resume, longest_prompt) -> int:
    script_args, config = spec.script, spec.config
    eval_ds = data.held_out
    trainer = build_trainer(spec, tokenizer, data, reward_funcs, longest_prompt)
    is_main = trainer.accelerator.is_main_process
    log(f"log-prob head: {trainer.logprob_impl}; activation offload: {offload_line(trainer)}")
    os.makedirs(config.output_dir, exist_ok=True)
    summary = {"model": script_args.model, "dataset": script_args.dataset, "run_name": config.run_name}
    if is_main:
        write_json(spec.resolved(), os.path.join(config.output_dir, "resolved_config.json"))

    if eval_ds is not None and not resume:
        summary["before"], records = _evaluate(trainer, tokenizer, data, script_args, "before")
        if is_main:
            write_json(records, os.path.join(config.output_dir, "heldout_before.json"))

    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    train_s = time.time() - t0
    guard = trainer.nonfinite_guard
    if guard is not None and guard.stopped_at is not None:
        raise guard.error(config.output_dir)  # NonFiniteStepsError naming the last good checkpoint
    if trainer.preemption.preempted:  # SIGTERM: checkpoint written; no evaluation or final save in the grace period
        return finish_preempted(trainer, config.output_dir)
    rows = step_rows(trainer.state.log_history)
    step_times = [r["step_time"] for r in rows if "step_time" in r]
    summary.update(steps=trainer.state.global_step, train_seconds=round(train_s, 1),
                   seconds_per_step=round(sum(step_times) / len(step_times), 2) if step_times else None)

    if eval_ds is not None:
        summary["after"], records = _evaluate(trainer, tokenizer, data, script_args, "after")
        if is_main:
            write_json(records, os.path.join(config.output_dir, "heldout_after.json"))
    trainer.save_model(os.path.join(config.output_dir, "final"))
    if is_main:
        _write_artifacts(config.output_dir, rows, summary)
        fix_model_card(config.output_dir, script_args.model)
    end_processes(trainer)
    return 0


def end_processes(trainer) -> None:
    """Several processes: every rank waits until the main one has written the final model and the artifacts, then
    accelerate tears the process group down before the interpreter exits. Without it a rank that finished first
    exited with gloo's threads alive while rank 0 still wrote: one 2-process ZeRO-3 run of tiny-gpt-oss in six
    aborted at exit ("terminate called without an active exception", its outputs complete)."""
    if several_processes():
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()


def finish_preempted(trainer, output_dir: str) -> int:
    """After train() returned on preemption: every rank waits for the others' checkpoint files, one line, exit 0."""
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        write_metrics_csv(step_rows(trainer.state.log_history), os.path.join(output_dir, "metrics.csv"))
        log(trainer.preemption.resume_line(output_dir))
    return 0


def offload_line(trainer) -> str:
    """'off', or 'on' with this process's host budget (its share of the machine: LOCAL_WORLD_SIZE processes)."""
    if not trainer.offload_enabled:
        return "off"
    budget = trainer.offload_config.host_budget_bytes
    if budget is None:
        return "on"
    k = local_processes()
    return f"on, host budget {budget / GIB:.1f} GiB per process (90% of free host memory / {k} process(es) here)"


def base_model_name(model: str) -> str:
    """What the model card calls the base model: the hub id, the embedded default's source, or a description."""
    from grpo_accel.data.models import DEFAULT_MODEL, TINY_CONFIGS, looks_like_hub_id

    if model in (DEFAULT_MODEL, "default"):
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
    if model in TINY_CONFIGS:
        return f"{model} (random weights, a test model)"
    return model if looks_like_hub_id(model) else os.path.abspath(model)


def fix_model_card(output_dir: str, model: str) -> None:
    """TRL's card says "fine-tuned version of [None]" for a local or embedded base model: name it, and point the
    quick-start snippet at the saved adapter."""
    from grpo_accel.app.report import atomic_write_text

    name = base_model_name(model)
    link = f"[{name}](https://huggingface.co/{name})" if " " not in name and not name.startswith("/") else name
    for card in (os.path.join(output_dir, "README.md"), os.path.join(output_dir, "final", "README.md")):
        if os.path.isfile(card):
            with open(card) as f:
                text = f.read()
            text = text.replace("[None](https://huggingface.co/None)", link)
            text = text.replace('model="None"', f'model="{os.path.join(output_dir, "final")}"')
            atomic_write_text(card, text)


def _write_artifacts(output_dir: str, rows: list[dict], summary: dict) -> None:
    write_metrics_csv(rows, os.path.join(output_dir, "metrics.csv"))
    acc = None
    if "accuracy_lenient" in summary.get("before", {}) and "after" in summary:
        acc = {"before": summary["before"]["accuracy_lenient"], "after": summary["after"]["accuracy_lenient"]}
    plot_reward_curve(rows, os.path.join(output_dir, "reward_curve.png"), title=summary["run_name"], accuracy=acc)
    write_json(summary, os.path.join(output_dir, "summary.json"))
    log(f"done: {summary.get('steps')} steps, {summary.get('seconds_per_step')} s/step; artifacts in {output_dir}")


def main_guarded(fn, *args) -> int:
    """`fn(*args)` under core.errors.run_guarded (one `error:` line and exit 2 for what the user can fix), said by
    each machine's first process: one line a terminal. Said by rank 0 alone, a two-machine launch's second machine
    exited 2 without a word (the multinode_zero3 loopback launch of tests/test_server_distributed.py)."""
    return run_guarded(fn, *args, speaks=local_rank() == 0, after_progress=True)
