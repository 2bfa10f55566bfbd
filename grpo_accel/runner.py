"""The body of launch/train.py: validate, load, evaluate, train, evaluate, write the run's artifacts.

Everything that can be checked before loading weights is checked first, so bad input fails in a
second with a message that names the fix, and no run directory is created for a run that never started.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from dataclasses import asdict

import torch
import yaml

from .console import log
from .data import DatasetError, prompt_lengths, train_eval_datasets
from .guards import NonFiniteStepsError
from .models import ModelLoadError, load_model, load_tokenizer, resolve_model_path
from .report import plot_reward_curve, step_rows, write_json, write_metrics_csv
from .rewards import RewardFunctionError, resolve_rewards

from .presets import PresetError

USER_ERRORS = (PresetError, ModelLoadError, NonFiniteStepsError, DatasetError, RewardFunctionError, FileNotFoundError, PermissionError)


def choose_preset(cli_preset: str | None):
    """The preset (--preset, else the launching YAML's, else the detected GPU's), checked against this GPU
    before any weights load."""
    from .presets import check_preset_fits_gpu, select_preset

    preset, why = select_preset(cli_preset)
    log(f"preset {preset.name}: {why}")
    check_preset_fits_gpu(preset)
    return preset


def check_plan_fits(script_args, config) -> None:
    """Refuse, before loading weights, a run the planner says cannot fit this GPU; names the fix."""
    import torch

    from .architectures import model_shape
    from .presets import get_preset

    if not torch.cuda.is_available():
        return
    preset = get_preset(script_args.preset)
    shape = model_shape(preset.architecture if script_args.model == preset.model else script_args.model)
    plan = preset.plan(shape=shape, max_completion_length=config.max_completion_length,
                       num_generations=config.num_generations,
                       per_device_batch=config.per_device_train_batch_size, lora_r=script_args.lora_r)
    verdict = plan.verdict(torch.cuda.get_device_properties(0).total_memory)
    log(f"memory plan: {plan.peak_gib:.1f} GiB predicted peak per GPU — {verdict}")
    if not verdict.fits:
        raise PresetError(f"this run does not fit: {verdict}")


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


def latest_complete_checkpoint(output_dir: str) -> str:
    """The newest checkpoint-N whose trainer_state.json (written last by the Trainer) parses: a kill during a
    save leaves a partial newest directory behind, and resuming must skip it for the previous good one."""
    import json
    import re

    found = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            match = re.fullmatch(r"checkpoint-(\d+)", name)
            if match:
                found.append((int(match.group(1)), os.path.join(output_dir, name)))
    for _, path in sorted(found, reverse=True):
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                json.load(f)
            return path
        except (OSError, ValueError):
            log(f"skipping incomplete checkpoint {path} (interrupted save)")
    raise FileNotFoundError(f"no complete checkpoint in {output_dir}. Fix: start without "
                            f"--resume_from_checkpoint, or point --output_dir at the run to continue.")


def check_output_dir(path: str) -> None:
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise PermissionError(f"output directory {path!r} is not writable (checked {parent}). Fix: pass a "
                              f"writable --output_dir.")


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
        raise ModelLoadError(f"LoRA target modules {missing} are not in {script_args.model}. Fix: --lora_target_modules "
                             f"with some of {sorted(linear - {'lm_head'})}, or all-linear.")


def check_context(model_config, tokenizer, dataset, max_completion_length: int) -> int:
    """A prompt + completion longer than the model's context fails deep inside generation; say so up front.
    Returns the longest prompt's tokens (the colocated engine's max_model_len is sized from it)."""
    longest, index = max((n, i) for i, n in enumerate(prompt_lengths(tokenizer, dataset["prompt"])))
    limit = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if limit and longest + max_completion_length > limit:
        raise DatasetError(f"prompt {index + 1} has {longest} tokens; with --max_completion_length "
                           f"{max_completion_length} that exceeds the model's context of {limit} tokens. Fix: lower "
                           f"--max_completion_length to {max(limit - longest, 0)} or drop the long prompts.")


def _evaluate(trainer_or_model, tokenizer, dataset, script_args, tag):
    from .evaluate import evaluate
    from .head import zero3_gather_ctx

    t0 = time.time()
    # Under ZeRO-3 every rank holds a shard: gather the whole model for generate() (costs one full copy of the
    # weights per rank while evaluating; every rank decodes the same greedy sequences, so they stay in step).
    with zero3_gather_ctx(*trainer_or_model.parameters()):
        acc, records = evaluate(trainer_or_model, tokenizer, dataset, max_new_tokens=script_args.eval_max_new_tokens,
                                batch_size=script_args.eval_batch_size, desc=f"held-out eval ({tag})",
                                disable_progress=int(os.environ.get("RANK", "0")) != 0)
    log(f"held-out accuracy {tag}: strict {acc['accuracy_strict']:.1%}, lenient {acc['accuracy_lenient']:.1%} "
        f"({len(records)} problems, {time.time() - t0:.0f} s)")
    return acc, records


def load_training_model(script_args, config, tokenizer, train_ds):
    """(model, colocated engine or None), the prompts checked against the model's context. With colocated vLLM and
    a bf16/fp32 model the engine loads the checkpoint and the training model is built around its weights, so no
    second copy exists even while loading."""
    from .models import TINY_CONFIGS
    from .vllm_setup import fallback_reason, start_colocated_engine

    colocate = config.use_vllm and config.vllm_mode == "colocate"
    if colocate and script_args.quantization == "none" and script_args.model not in TINY_CONFIGS:
        if fallback_reason(script_args.model, config) is None:
            from transformers import AutoConfig

            # Before the engine loads anything: a too-long prompt should fail in a second, not after start-up.
            longest = check_context(AutoConfig.from_pretrained(resolve_model_path(script_args.model)), tokenizer,
                                    train_ds, config.max_completion_length)
            engine, model = start_colocated_engine(script_args.model, config, peft_config=lora_config(script_args),
                                                   longest_prompt=longest,
                                                   dtype=getattr(torch, script_args.model_dtype))
            return model, engine
    # Otherwise (no vLLM, a 4-bit or tiny model) the trainer starts an unshared engine or says why it cannot.
    model, _ = load_model(script_args.model, dtype=script_args.model_dtype, quantization=script_args.quantization)
    check_context(model.config, tokenizer, train_ds, config.max_completion_length)
    return model, None


def run(script_args, config) -> int:
    from .trainer import GRPOAccelTrainer

    check_output_dir(config.output_dir)
    settle_lora_alpha(script_args)
    check_plan_fits(script_args, config)
    resume = config.resume_from_checkpoint
    if resume == "latest":
        resume = latest_complete_checkpoint(config.output_dir)
        log(f"resuming from {resume}")
    elif resume and not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise FileNotFoundError(f"{resume} is not a complete checkpoint (no trainer_state.json). Fix: pass "
                                f"--resume_from_checkpoint latest, or another checkpoint-N directory.")
    reward_funcs = resolve_rewards(script_args.rewards)
    tokenizer = load_tokenizer(script_args.model)
    if not tokenizer.chat_template:
        raise ModelLoadError(f"the tokenizer of {script_args.model!r} has no chat template. Fix: use an "
                             f"instruct/chat model, or set tokenizer.chat_template in a local copy.")
    train_ds, eval_ds = train_eval_datasets(script_args.dataset, script_args.train_size, script_args.eval_size,
                                            level=script_args.dataset_level, seed=config.seed)
    log(f"model {script_args.model} ({script_args.model_dtype}), dataset {script_args.dataset}: "
        f"{len(train_ds)} train / {len(eval_ds) if eval_ds is not None else 0} held-out prompts")
    configure_tracking(config)

    model, engine = load_training_model(script_args, config, tokenizer, train_ds)
    check_lora_targets(model, script_args)
    trainer = GRPOAccelTrainer(model=model, reward_funcs=reward_funcs, args=config, vllm_engine=engine,
                               train_dataset=train_ds, processing_class=tokenizer,
                               peft_config=lora_config(script_args))
    is_main = trainer.accelerator.is_main_process
    log(f"log-prob head: {trainer.logprob_impl}; activation offload: {'on' if trainer.offload_enabled else 'off'}")
    os.makedirs(config.output_dir, exist_ok=True)
    summary = {"model": script_args.model, "dataset": script_args.dataset, "run_name": config.run_name}
    if is_main:
        write_json({"script": asdict(script_args), "config": config.to_dict()},
                   os.path.join(config.output_dir, "resolved_config.json"))

    if eval_ds is not None and not resume:
        summary["before"], records = _evaluate(trainer.model, tokenizer, eval_ds, script_args, "before")
        if is_main:
            write_json(records, os.path.join(config.output_dir, "heldout_before.json"))

    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    train_s = time.time() - t0
    guard = trainer.nonfinite_guard
    if guard is not None and guard.stopped_at is not None:
        raise guard.error(config.output_dir)  # NonFiniteStepsError naming the last good checkpoint
    if trainer.preemption.preempted:  # SIGTERM: checkpoint written; no evaluation or final save in the grace period
        from .preemption import finish_preempted

        return finish_preempted(trainer, config.output_dir)
    rows = step_rows(trainer.state.log_history)
    step_times = [r["step_time"] for r in rows if "step_time" in r]
    summary.update(steps=trainer.state.global_step, train_seconds=round(train_s, 1),
                   seconds_per_step=round(sum(step_times) / len(step_times), 2) if step_times else None)

    if eval_ds is not None:
        summary["after"], records = _evaluate(trainer.model, tokenizer, eval_ds, script_args, "after")
        if is_main:
            write_json(records, os.path.join(config.output_dir, "heldout_after.json"))
    trainer.save_model(os.path.join(config.output_dir, "final"))
    if is_main:
        _write_artifacts(config.output_dir, rows, summary)
    return 0


def _write_artifacts(output_dir: str, rows: list[dict], summary: dict) -> None:
    write_metrics_csv(rows, os.path.join(output_dir, "metrics.csv"))
    acc = None
    if "before" in summary and "after" in summary:
        acc = {"before": summary["before"]["accuracy_lenient"], "after": summary["after"]["accuracy_lenient"]}
    plot_reward_curve(rows, os.path.join(output_dir, "reward_curve.png"), title=summary["run_name"], accuracy=acc)
    write_json(summary, os.path.join(output_dir, "summary.json"))
    log(f"done: {summary.get('steps')} steps, {summary.get('seconds_per_step')} s/step; artifacts in {output_dir}")


def main_guarded(fn, *args) -> int:
    """Run `fn`, turning the errors a user can fix into one clear line and exit code 2."""
    try:
        return fn(*args)
    except USER_ERRORS as exc:
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)  # newline: a progress bar may be mid-line
        return 2
    except yaml.YAMLError as exc:
        print(f"\nerror: the --config file is not valid YAML: {' '.join(str(exc).split())}. Fix: correct it at "
              f"that line (keys are GRPOAccelConfig / script flags without the dashes).", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        print(f"\nerror: disk full while writing {exc.filename or 'the run'}. Fix: free space or pass another "
              f"--output_dir; files are written via rename, so the previous checkpoint and artifacts are intact, "
              f"and --resume_from_checkpoint latest skips the interrupted save.", file=sys.stderr, flush=True)
        return 2
    except ValueError as exc:  # config validation (ours and TRL's) says what is wrong
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)  # newline: a progress bar may be mid-line
        return 2
