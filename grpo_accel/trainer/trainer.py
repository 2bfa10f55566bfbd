"""GRPOAccelTrainer: TRL's GRPOTrainer with grpo_accel's memory savers plugged into its hooks.

Overrides as little as possible; the loss math stays TRL's (`_compute_loss`), so our numbers are
TRL's numbers. What it adds:
- `_get_per_token_logps_and_entropies` (TRL's one hook for the policy, old and reference log-probs)
  goes through our fused head (`logprob_impl`: chunked / triton / auto; "trl" keeps TRL's own), in
  mini-batches of `logprob_mini_batch` rows;
- activation offload installed as the model's gradient-checkpointing function (`offload_activations`);
- reward functions are wrapped so a failing one is named in a clear error, never a silent 0;
- per-phase peak memory (generation, old/ref log-probs, policy forward, backward, optimizer step)
  logged with every step (`telemetry.py`);
- `use_vllm=True, vllm_mode="colocate"`: one in-process engine whose base weights are the training model's
  (LoRA), sized by the memory planner, the adapter pushed from memory after each optimizer step
  (`vllm_setup.py`, `vllm_colocate.py`). Without vLLM, one line says generation takes transformers' continuous
  batching (route continuous_batching) or, where that cannot run, generate();
- `use_transformers_continuous_batching`: TRL's branch without its in-place bf16 cast of the trained weights, the
  page pool sized by the planner (`paged_generation.py`).
Every patch a saver makes (the models' forwards, checkpointing function, attention registrations) is undone when
train() ends, however it ends (`close()`, `patches.py`): a second model in the same process runs stock code.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref

import torch
from trl import GRPOTrainer

from grpo_accel._compat.hook_leak import dedupe_input_require_grads
from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError
from grpo_accel.core.model_access import causal_lm_of
from grpo_accel.core.patches import Patches
from grpo_accel.core.settings import (
    SHARE_PROMPT_MIN_SAVED,
    RunSettings,
    setting,
    share_prompt_blocker,
    share_prompt_pays,
    shared_group_tokens,
)
from grpo_accel.generation.server_generation import ServerGeneration
from grpo_accel.generation.vllm_colocate import SharedVLLM, unsupported_options
from grpo_accel.generation.vllm_generation import SharedVLLMGeneration, sampling_settings
from grpo_accel.generation.vllm_setup import colocated_route, start_colocated_engine
from grpo_accel.head.logprob_head import head_unsupported_reason, install_logprob_head
from grpo_accel.offload import OffloadConfig, install_activation_offload, remove_activation_offload
from grpo_accel.offload.residency import host_budget_per_process
from grpo_accel.ops.select import triton_usable
from grpo_accel.parallel.packing import (
    ATTN_NAME,
    enable_packed_attention,
    packing_unsupported_reason,
)
from grpo_accel.planning.memory import shortest_shared_prompt
from grpo_accel.trainer.callbacks.guards import DeepSpeedSkipGuard, NonFiniteGuard, check_reward_rows
from grpo_accel.trainer.callbacks.learning_signal import LearningSignalWatch
from grpo_accel.trainer.callbacks.preemption import Preemption
from grpo_accel.trainer.callbacks.telemetry import PhaseTelemetry
from grpo_accel.trainer.carried_rollouts import (
    attach_rollout_budget,
    carried_single_turn,
    generate_and_score,
    load_rollouts,
    save_rollouts,
)
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.logprob_passes import logps_and_entropies
from grpo_accel.trainer.paged_generation import paged_single_turn
from grpo_accel.trainer.reward_guard import guarded
from grpo_accel.trainer.server_mode import ask_ahead, attach_server, read_ahead

# Tests force the real stash/copy/restore path on CPU (where "host" and "device" are the same memory).
FORCE_OFFLOAD_COPIES_ENV = "GRPO_ACCEL_OFFLOAD_FORCE_COPIES"


def share_prompt_line(mode: str, G: int, C: int, longest_prompt: int | None = None) -> str:
    """The one start-up line of share_prompt "auto" / "true": where it shares and, at the dataset's longest prompt
    (when known), what a group of G completions of C tokens then runs through the log-prob passes."""
    where = "every group" if mode == "true" else (
        f"groups whose sharing removes >= {SHARE_PROMPT_MIN_SAVED:.0%} of their tokens (at {C}-token completions: "
        f"prompts of >= {shortest_shared_prompt(C, G)} tokens)")
    line = (f"share_prompt={mode}: the log-prob passes run each prompt once for its {G} completions, in {where}; a "
            f"group's G x (P + C) tokens become P - 1 + G x (C + 1) (share_prompt/token_ratio per step)")
    if longest_prompt is None:
        return line
    shared, unshared = shared_group_tokens(longest_prompt, [C] * G), G * (longest_prompt + C)
    if share_prompt_pays(longest_prompt, [C] * G, mode):
        return (f"{line}; at this dataset's longest prompt, {longest_prompt} tokens, {shared} instead of {unshared} "
                f"({unshared / shared:.1f}x fewer)")
    return (f"{line}; this dataset's longest prompt, {longest_prompt} tokens, beside {C}-token completions would "
            f"save {1 - shared / unshared:.0%} (auto shares a group, per batch, from {SHARE_PROMPT_MIN_SAVED:.0%})")


class GRPOAccelTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with the memory savers wired into its hooks: the fused log-prob head and padding-free
    packing in `_get_per_token_logps_and_entropies`, activation offload and sequence tiles as the model's
    gradient-checkpointing function, Ulysses SP around the policy forward, a colocated vLLM engine that shares the
    training model's weights as `vllm_generation`. Everything it adds is undone by `close()` (end of `train()`)."""

    def __init__(self, model, reward_funcs=None, args: GRPOAccelConfig | None = None, *trl_args, vllm_engine=None,
                 longest_prompt: int | None = None, **kwargs):
        """As GRPOTrainer: every argument of TRL's, by name or in its order; `vllm_engine` (by name only): an engine
        already started with `vllm_setup.start_colocated_engine` whose training model is `model` (else one is
        started here when args ask for colocated vLLM). `longest_prompt` (by name only): the training prompts'
        longest in tokens, where the caller measured it (launch/train.py): the share_prompt line then says what
        sharing does at it. A TRL GRPOConfig is taken as it is: our fields get their defaults."""
        self.longest_prompt = longest_prompt
        if trl_args:  # train_dataset, eval_dataset, processing_class, ... given by position, as TRL allows
            import inspect

            names = list(inspect.signature(GRPOTrainer.__init__).parameters)[4:]
            kwargs.update(zip(names, trl_args, strict=False))
        if args is None:  # as TRL names its default config, ours
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOAccelConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        elif not isinstance(args, GRPOAccelConfig):
            args = GRPOAccelConfig.from_trl(args)
        if reward_funcs is not None:  # None: rewards owned by the environments (TRL's environment_factory)
            if not isinstance(reward_funcs, (list, tuple)):
                reward_funcs = [reward_funcs]
            # Reward models (nn.Module) and hub ids (str) are TRL's business; plain functions get the guard.
            strict = args.reward_checks == "strict"
            reward_funcs = [f if isinstance(f, (str, torch.nn.Module))
                            else guarded(f, strict=strict) for f in reward_funcs]
        if vllm_engine is None and args is not None and args.use_vllm and args.vllm_mode == "colocate":
            vllm_engine, model = self._start_engine(model, args, kwargs)
        # server mode with an adapter: ours (adapter-only sync, steps ahead); full fine-tuning: TRL's own (NCCL)
        adapter_server = args.use_vllm and args.vllm_mode == "server" and (
            kwargs.get("peft_config") is not None or hasattr(model, "peft_config"))
        if vllm_engine is not None or adapter_server:
            args.use_vllm = False  # TRL must not start its own engine (a second copy) or its NCCL client
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self.vllm_engine = vllm_engine
        if vllm_engine is not None:
            args.use_vllm = True
            attach_shared_vllm(self, vllm_engine)
        self._ahead: tuple = (None, [])  # (epoch iterator, its micro-batches read ahead): get_batch_samples
        self._next_generation_rows = None  # the next generation batch's rows, for the server to sample ahead
        if adapter_server:
            args.use_vllm = True
            attach_server(self)
        self.rollouts = None  # --rollout_budget: the rollouts in flight on this rank (carried_rollouts.py)
        if self.args.rollout_budget:
            attach_rollout_budget(self)
        self.learning_signal = LearningSignalWatch(self.args.max_completion_length)
        self.add_callback(self.learning_signal)
        self.telemetry = PhaseTelemetry()
        self.telemetry.wrap_backward(self.accelerator)
        self.add_callback(self.telemetry.callback())
        # SIGTERM: finish the step in flight, save, stop (added before the guard, whose no-save on a stop wins).
        self.preemption = Preemption(self.accelerator)
        self.add_callback(self.preemption)
        # TRL re-enables checkpointing around each generate(); transformers then adds an embedding hook each time.
        dedupe_input_require_grads(self.model)
        # Under DeepSpeed the engine owns the optimizer step and skips non-finite ones itself: count its skips.
        # 0 (the default): TRL's behaviour, no guard; launch/train.py asks for 3
        max_bad = self.args.max_nonfinite_steps
        self.nonfinite_guard = None
        if max_bad > 0:
            self.nonfinite_guard = (DeepSpeedSkipGuard(max_bad, self.accelerator) if self.is_deepspeed_enabled
                                    else NonFiniteGuard(max_bad, self.accelerator))
            self.add_callback(self.nonfinite_guard)
        self.patches = Patches()
        weakref.finalize(self, self.patches.undo)  # a trainer dropped without train() (a notebook cell) undoes too
        self._install_savers()

    def _install_savers(self) -> None:
        """Every saver that patches a model or a process-wide registry, its undo kept in `self.patches`: `close()`
        (run when train() ends, however it ends) leaves the models and transformers' registries as they were.
        `self.settings`: the config's settings as they run on this device (core.settings.RunSettings), read below."""
        self.settings = RunSettings.resolve(self.args, cuda=torch.device(self.accelerator.device).type == "cuda")
        self.offload_config = self._offload_config()
        self.offload_enabled = self.offload_config is not None
        self._refuse_router_loss_pairs()
        if self.offload_enabled:
            install_activation_offload(self.model, self.offload_config)
            self.patches.add(lambda model=self.model: remove_activation_offload(model))
        self.logprob_impl = self._install_logprob_head()
        self.sequence_parallel = self._install_sequence_parallel()
        if self.sequence_parallel is not None:
            self.patches.add(self.sequence_parallel.remove)
            self._refuse_router_loss_pairs()
        # SP shards carry their own positions through Ulysses' SDPA: no packed rows under it
        self.padding_free = self._install_padding_free() if self.sequence_parallel is None else False
        self.share_prompt = self._install_share_prompt()
        self._token_counts = [0, 0]  # tokens the packed passes ran, and would have run unshared (since the last log)
        if self.sequence_parallel is not None and self.settings.padding_free:  # mini-batch caps: refused in config.py
            log("sequence parallelism: each pass runs the group's rows in one forward, unpadded and split along "
                "their length; padding_free does not apply")
        self.savers_installed = True

    def _refuse_router_loss_pairs(self) -> None:
        """A MoE's router loss (TRL adds it when the config has router_aux_loss_coef) back-propagates through each
        layer's router logits, a side output. The offloaded checkpoint re-runs a layer from its input for its output
        only (measured: the step's gradients then differ from TRL's), and Ulysses shards would each see part of
        the tokens: both refused here, before any step."""
        if not getattr(self, "aux_loss_enabled", False):
            return
        fix = "Fix: --router_aux_loss_coef 0 (GRPOConfig's: no router loss)"
        if self.offload_enabled and self.args.offload_activations == "auto":
            log("offload_activations=auto: off, the MoE router loss needs each layer's router logits "
                "(--router_aux_loss_coef 0 turns the loss off and offload back on)")
            self.offload_config, self.offload_enabled = None, False
        if self.offload_enabled:
            raise ConfigError("--offload_activations cannot run with the MoE router loss: the offloaded re-run does "
                              f"not return the router logits that loss differentiates. {fix}, or "
                              "--offload_activations false.")
        if getattr(self, "sequence_parallel", None) is not None:
            raise ConfigError("--sequence_parallel_size > 1 cannot run with the MoE router loss: each rank holds "
                              f"part of each row's router logits. {fix}.")

    def close(self) -> None:
        """Undo the savers' patches. The trainer then runs TRL's own paths (its attributes still say which savers it
        ran with); train() installs them again."""
        self.patches.undo()
        self.savers_installed = False

    def train(self, *args, **kwargs):
        """TRL's train() with the savers on; however it ends (on_train_end never runs when a step raises), the SIGTERM
        handler and the savers' patches are undone: a second model in this process runs stock code."""
        if not hasattr(self, "patches"):  # made without our __init__: TRL's train()
            return super().train(*args, **kwargs)
        if not self.savers_installed:
            self._install_savers()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.preemption.uninstall()
            if isinstance(getattr(self, "vllm_generation", None), ServerGeneration):
                self.vllm_generation.close()  # batches asked for ahead: nobody will train on them
            self.close()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards; with reward_checks="strict" a row no reward scored, or a reward model's NaN / inf, stops
        the run (guards.check_reward_rows). Every process holds the gathered tensor, so all of them stop together."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if setting(self.args, "reward_checks") == "strict":  # a TRL GRPOConfig (TRL's tests): its default
            models = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, torch.nn.Module)]
            check_reward_rows(rewards_per_func, list(self.reward_func_names), models)
        return rewards_per_func

    def score_completions(self, rows: list[dict], completions: list[str]) -> list[float]:
        """The weighted reward of each completion of `rows` (dataset rows: `prompt` and the columns the rewards read)
        as training scores it (TRL's `_calculate_rewards`, then the weighted nan-sum; NaN where no reward applies).
        Used by the held-out evaluation of datasets without answers; every process must call it (it gathers)."""
        prompts = [row["prompt"] for row in rows]
        if isinstance(prompts[0], list):  # conversational: TRL hands completions over as assistant messages
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        inputs = [{**row, "completion": c} for row, c in zip(rows, completions)]
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        ids = [self.processing_class(t, add_special_tokens=False)["input_ids"] for t in texts]
        # TRL's own scoring (no strict stop: an evaluation reports blank rows as NaN instead)
        per_func = super()._calculate_rewards(inputs, prompts, completions, ids)[: len(rows)]
        weighted = per_func * self.reward_weights.to(per_func.device).unsqueeze(0)
        blank = per_func.isnan().all(dim=1)
        return weighted.nansum(dim=1).masked_fill(blank, float("nan")).tolist()

    @staticmethod
    def _start_engine(model, args, kwargs):
        """(engine, model) for colocated generation, or (None, model) with one line when it cannot run here."""
        peft_config = kwargs.get("peft_config")
        action, route = colocated_route(model, args, lora_r=int(peft_config.r) if peft_config is not None else 0)
        if action == "fallback":
            log(route)  # the line: transformers' route and the package that would give this run an engine
            args.use_vllm = False
            args.use_transformers_continuous_batching = route.startswith("generation route continuous_batching:")
            return None, model
        return start_colocated_engine(model, args, peft_config=peft_config, route=route,
                                      train_dataset=kwargs.get("train_dataset"),
                                      tokenizer=kwargs.get("processing_class"))

    def _install_logprob_head(self) -> str:
        impl = self.settings.logprob_impl
        if impl == "trl":
            return impl
        if impl == "auto":
            impl = "triton" if triton_usable(self.accelerator.device) else "chunked"
        reason = head_unsupported_reason(causal_lm_of(self.model))
        if reason:
            warnings.warn(f"logprob_impl={impl!r} falls back to TRL's head: {reason}.", stacklevel=3)
            return "trl"
        for m in (self.model, self.ref_model):
            if m is not None:
                self.patches.add(install_logprob_head(
                    m, temperature=self.temperature, impl=impl, chunk_size=self.settings.logprob_chunk_size,
                    vocab_tile=self.settings.logprob_vocab_tile,
                    offload=self.offload_config if m is self.model else None))
        return impl

    def _install_sequence_parallel(self):
        """Ulysses SP for the log-prob passes (sequence_parallel.py) when sequence_parallel_size > 1, else None."""
        sp = self.settings.sequence_parallel_size
        if sp <= 1:
            return None
        from grpo_accel.parallel import sequence_parallel

        return sequence_parallel.enable(sp, **self.sequence_parallel_arguments())

    def sequence_parallel_arguments(self) -> dict:
        """What sequence_parallel.enable takes from this trainer: the models carrying our head and its settings."""
        return dict(models=[self.model, self.ref_model], logprob_impl=self.logprob_impl,
                    train_dataset=self.train_dataset, temperature=self.temperature,
                    chunk_size=self.settings.logprob_chunk_size, vocab_tile=self.settings.logprob_vocab_tile,
                    offload=self.offload_config if self.offload_enabled else None)

    def _install_padding_free(self) -> bool:
        """Whether the log-prob passes pack rows (packing.py); one line saying why not when asked for and impossible."""
        if not self.settings.padding_free:
            return False
        # unwrapped: under DeepSpeed TRL has already wrapped the reference model in an engine
        models = [causal_lm_of(m) for m in (self.model, self.ref_model) if m is not None]
        reason = next(filter(None, map(packing_unsupported_reason, models)), None)
        if reason:
            log(f"padding_free falls back to padded rows: {reason}.")
            return False
        for m in models:
            self.patches.add(enable_packed_attention(m).undo)
        log("padding_free: log-prob passes run on packed rows of real tokens (no padding).")
        return True

    def _install_share_prompt(self) -> str:
        """The shared-prompt mode the log-prob passes run ("false" where the layout cannot run: "auto" says nothing,
        "true" stops with one line), and one line saying it is on and where it pays."""
        mode = self.settings.share_prompt
        if mode == "false":
            return mode
        models = [causal_lm_of(m) for m in (self.model, self.ref_model) if m is not None]
        # padding_free as resolved here (packing may have fallen back), the SP group as enabled
        why_not = share_prompt_blocker(self.padding_free, self.sequence_parallel.sp if self.sequence_parallel else 1)
        if why_not is None and any(m.config._attn_implementation != ATTN_NAME for m in models):
            why_not = ("the model's attention is not sdpa (flash_attention_2/3 read each sequence from position ids, "
                       "which a shared prompt does not restart)")
        if why_not:
            if mode == "true":
                raise ConfigError(f"--share_prompt true cannot run: {why_not}. Fix: --share_prompt auto or false.")
            return "false"
        log(share_prompt_line(mode, self.num_generations, self.args.max_completion_length, self.longest_prompt))
        return mode

    def _offload_config(self) -> OffloadConfig | None:
        """None when offload is off; else how to offload (the layer inputs and the head's hidden states)."""
        if not self.settings.offload_activations:
            return None
        if os.environ.get(FORCE_OFFLOAD_COPIES_ENV) == "1":
            return OffloadConfig.from_settings(self.settings, device_copies=True, use_streams=False,
                                               pin_memory=False, min_bytes=0)
        # 90% of what the host has free now, shared by this machine's processes: a wrong plan stops with
        # HostMemoryError, not the OOM killer
        host = host_budget_per_process(0.9) if torch.device(self.accelerator.device).type == "cuda" else None
        return OffloadConfig.from_settings(self.settings, host_budget_bytes=host)

    # An instance may come without our __init__ (TRL's own tests build trainers with __new__ and set what they need):
    # every override then runs TRL's code, nothing of ours assumed to exist.
    def _phase(self, name: str):
        telemetry = getattr(self, "telemetry", None)
        return telemetry.phase(name) if telemetry is not None else contextlib.nullcontext()

    def _generate(self, prompts):
        with self._phase("generation"):
            # under SP: once per SP group, split over its ranks
            if getattr(self, "sequence_parallel", None) is not None and self.model.training:
                return self.sequence_parallel.generate_once(super()._generate, prompts)
            return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs):
        """TRL's; with --rollout_budget, on the groups complete this step, which may be carried from an earlier one
        (carried_rollouts.py)."""
        if getattr(self, "rollouts", None) is not None and self.model.training:
            return generate_and_score(self, inputs, super()._generate_and_score_completions)
        return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's; its continuous-batching branch replaced by ours (paged_generation.py: no cast of the weights). With
        a server sampling ahead, the next generation batch is asked for once this one is in hand: the server samples
        it with this step's adapter while this step trains. With --rollout_budget: the groups this step trains."""
        if getattr(self, "rollouts", None) is not None:
            out = carried_single_turn(self, prompt_ids)
            if out is not None:
                return out
        if getattr(self, "use_transformers_continuous_batching", False) and not self.use_vllm \
                and hasattr(self, "patches"):
            return paged_single_turn(self, prompt_ids)
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self._samples_ahead() and self.model.training:
            ask_ahead(self, num_generations)
        return out

    def _samples_ahead(self) -> bool:
        return isinstance(getattr(self, "vllm_generation", None), ServerGeneration) and self.args.max_staleness >= 1

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers'; with a server sampling ahead, or --rollout_budget starting the next batch's prompts early, it
        also reads the next generation batch (server_mode.py)."""
        if not (self._samples_ahead() or getattr(self, "rollouts", None) is not None):
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = read_ahead(self, epoch_iterator, num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def _save_checkpoint(self, model, trial):
        """transformers'; with --rollout_budget every rank's rollouts in flight go in first (trainer_state.json, written
        last, completes the checkpoint: carried_rollouts.save_rollouts)."""
        if getattr(self, "rollouts", None) is not None:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            save_rollouts(self, os.path.join(self._get_output_dir(trial=trial),
                                             f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
        return super()._save_checkpoint(model, trial)

    def _load_rng_state(self, checkpoint):
        """transformers' (called once when train() resumes from `checkpoint`); the rollouts in flight come back too."""
        if checkpoint is not None and getattr(self, "rollouts", None) is not None:
            load_rollouts(self, checkpoint)
        return super()._load_rng_state(checkpoint)

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler; under SP each batch goes to every rank of an SP group (sequence_parallel.py)."""
        sampler = super()._get_train_sampler(dataset)
        if getattr(self, "sequence_parallel", None) is None:
            return sampler
        from grpo_accel.parallel.sequence_parallel import GroupSharedSampler

        return GroupSharedSampler(sampler, self._train_batch_size * self.args.steps_per_generation,
                                  self.sequence_parallel.sp)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and getattr(self, "telemetry", None) is not None:
            logs.update(self.telemetry.pop_metrics())
            if self.nonfinite_guard is not None:
                logs.update(self.nonfinite_guard.metrics())
            if isinstance(getattr(self, "vllm_generation", None), ServerGeneration):
                logs.update(self.vllm_generation.metrics())
            if getattr(self, "rollouts", None) is not None:
                logs.update(self.rollouts.metrics())
            ran, unshared = getattr(self, "_token_counts", (0, 0))
            if getattr(self, "share_prompt", "false") != "false" and unshared:
                logs["share_prompt/token_ratio"] = ran / unshared  # 1.0: nothing shared
                self._token_counts = [0, 0]
        super().log(logs, start_time)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # No grad: the old-policy / reference passes in generate-and-score; with grad: the policy forward.
        if not getattr(self, "savers_installed", False):  # closed (after train()), or made without our __init__
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        with self._phase("policy_forward" if torch.is_grad_enabled() else "logps_no_grad"):
            return logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                       compute_entropy, compute_aux_loss, **multimodal)


def attach_shared_vllm(trainer, engine: SharedVLLM) -> SharedVLLMGeneration:
    """Route a TRL 1.16 GRPOTrainer's generation through `engine` (call right after the trainer's __init__). Here,
    in trainer/, because it writes TRL's own state: the generation layer only builds the object TRL calls.

    The trainer must have been built with `use_vllm=False` (else TRL already created a second engine with a
    second copy of the weights) from a model that `engine.build_training_model()` returned. Sets
    `trainer.use_vllm = True`, `trainer.vllm_mode = "colocate"`, `trainer.vllm_generation` (this object),
    `trainer._last_loaded_step = -1`; TRL's `_generate_single_turn` then calls our `sync_weights` (adapter only)
    and `generate`, and its importance-sampling correction uses the engine's log-probs as usual.
    """
    if getattr(trainer, "vllm_generation", None) is not None:
        raise ValueError("the trainer already has a vLLM engine (use_vllm=True): build it with use_vllm=False and "
                         "attach the shared engine afterwards, or it holds two engines")
    refusal = unsupported_options(trainer.args)
    if refusal:
        raise ConfigError(refusal)
    generation = SharedVLLMGeneration(engine, policy=lambda: trainer.accelerator.unwrap_model(trainer.model),
                                      sampling=sampling_settings(trainer.args))
    trainer.use_vllm = True
    trainer.vllm_mode = "colocate"
    trainer.vllm_generation = generation
    trainer._last_loaded_step = -1
    return generation

