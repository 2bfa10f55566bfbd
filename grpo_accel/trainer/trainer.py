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
- generation through one mode object per route (`generation_modes.py`: colocated vLLM sharing the weights,
  continuous batching, a `vllm serve` server, --rollout_budget); `dynamic_sampling` (`dynamic_sampling.py`);
  truncated sampling's behaviour log-probs on the trainer's distribution (`truncated_sampling.py`).
Every patch a saver makes (the models' forwards, checkpointing function, attention registrations) is undone when
train() ends, however it ends (`close()`, `patches.py`): a second model in the same process runs stock code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from grpo_accel._compat.hook_leak import dedupe_input_require_grads
from grpo_accel.core.patches import Patches
from grpo_accel.core.settings import setting
from grpo_accel.trainer.callbacks.guards import DeepSpeedSkipGuard, NonFiniteGuard, check_reward_rows
from grpo_accel.trainer.callbacks.learning_signal import LearningSignalWatch
from grpo_accel.trainer.callbacks.preemption import Preemption
from grpo_accel.trainer.callbacks.telemetry import PhaseTelemetry
from grpo_accel.trainer.carried_rollouts import BudgetMode
from grpo_accel.trainer.config import GRPOAccelConfig
from grpo_accel.trainer.dynamic_sampling import DynamicSampling, flat_groups
from grpo_accel.trainer.generation_modes import ColocatedVLLMMode, GenerationMode, start_engine
from grpo_accel.trainer.logprob_passes import logps_and_entropies
from grpo_accel.trainer.paged_generation import ContinuousBatchingMode
from grpo_accel.trainer.reward_guard import guarded
from grpo_accel.trainer.savers import SaverInstallers
from grpo_accel.trainer.server_mode import ServerMode
from grpo_accel.trainer.truncated_sampling import kept_mass_correction


class GRPOAccelTrainer(SaverInstallers, GRPOTrainer):
    """TRL's GRPOTrainer with the memory savers wired into its hooks: the fused log-prob head and padding-free
    packing in `_get_per_token_logps_and_entropies`, activation offload and sequence tiles as the model's
    gradient-checkpointing function, Ulysses SP around the policy forward, a colocated vLLM engine that shares the
    training model's weights as `vllm_generation`. Everything it adds is undone by `close()` (end of `train()`)."""

    round_rewards = None  # the last generation round's weighted rewards, every process's rows (_calculate_rewards)

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
            vllm_engine, model = start_engine(model, args, kwargs)
        # server mode with an adapter: ours (adapter-only sync, steps ahead); full fine-tuning: TRL's own (NCCL)
        adapter_server = args.use_vllm and args.vllm_mode == "server" and (
            kwargs.get("peft_config") is not None or hasattr(model, "peft_config"))
        if vllm_engine is not None or adapter_server:
            args.use_vllm = False  # TRL must not start its own engine (a second copy) or its NCCL client
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self.vllm_engine = vllm_engine
        if vllm_engine is not None or adapter_server:
            args.use_vllm = True
        self.generation_mode = self._generation_mode(vllm_engine, adapter_server)
        self.dynamic_sampling = DynamicSampling(self) if self.args.dynamic_sampling else None
        self.kept_mass_correction = kept_mass_correction(self)  # None unless a recorded sampler truncates
        self.learning_signal = LearningSignalWatch(self.args.max_completion_length)
        self.add_callback(self.learning_signal)
        self.telemetry = PhaseTelemetry()
        self.telemetry.wrap_backward(self.accelerator)
        self.add_callback(self.telemetry.callback())
        # SIGTERM: finish the step in flight, save, stop (added before the guard, whose no-save on a stop wins)
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

    def _generation_mode(self, engine, adapter_server: bool) -> GenerationMode:
        """The route's one mode object (generation_modes.py), decided once: the shared engine, the server, transformers'
        continuous batching or TRL's generate(); under --rollout_budget, the budget over it."""
        if engine is not None:
            mode = ColocatedVLLMMode(self, engine)
        elif adapter_server:
            mode = ServerMode(self)
        elif getattr(self, "use_transformers_continuous_batching", False) and not self.use_vllm:
            mode = ContinuousBatchingMode()
        else:
            mode = GenerationMode()  # TRL's own generate()
        return BudgetMode.over(self, mode) if self.args.rollout_budget else mode

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
            self.generation_mode.close()  # e.g. the batches a server was asked for ahead: nobody will train on them
            self.close()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards; with reward_checks="strict" a row no reward scored, or a reward model's NaN / inf, stops
        the run (guards.check_reward_rows). Every process holds the gathered tensor, so all of them stop together."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if setting(self.args, "reward_checks") == "strict":  # a TRL GRPOConfig (TRL's tests): its default
            models = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, torch.nn.Module)]
            check_reward_rows(rewards_per_func, list(self.reward_func_names), models)
        weighted = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        self.round_rewards = weighted.masked_fill(rewards_per_func.isnan().all(dim=1), float("nan"))
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

    # An instance may come without our __init__ (TRL's own tests build trainers with __new__ and set what they need):
    # every override then runs TRL's code, nothing of ours assumed to exist.
    def _phase(self, name: str):
        telemetry = getattr(self, "telemetry", None)
        return telemetry.phase(name) if telemetry is not None else contextlib.nullcontext()

    def _generate(self, prompts):
        """TRL's, timed as the `generation` memory phase; under SP once per group, split over its ranks."""
        with self._phase("generation"):
            if getattr(self, "sequence_parallel", None) is not None and self.model.training:
                return self.sequence_parallel.generate_once(super()._generate, prompts)
            return super()._generate(prompts)

    def _mode(self) -> GenerationMode | None:
        return getattr(self, "generation_mode", None)  # None: made without our __init__ (TRL's own paths)

    def _generate_and_score_completions(self, inputs):
        """TRL's, through the generation mode while training (--rollout_budget: the groups complete this step, some
        maybe carried); a truncating sampler's behaviour log-probs on the trainer's distribution (truncated_sampling);
        --dynamic_sampling fills the batch with groups whose rewards differ (frac_reward_zero_std: its test)."""
        trls = super()._generate_and_score_completions
        correction = getattr(self, "kept_mass_correction", None)
        if correction is not None:
            trls = functools.partial(correction.score, trls)
        mode = self._mode()
        if mode is None or not self.model.training:
            return trls(inputs)

        def scored(rows):
            out = trls(rows)
            flat = flat_groups(self.round_rewards, self.num_generations)
            self._metrics["train"]["frac_reward_zero_std"][-1] = flat.float().mean().item()
            return out

        generate = functools.partial(mode.generate_and_score, self, score=scored)
        refill = functools.partial(mode.refill_and_score, self, score=scored)
        ds = self.dynamic_sampling
        output = ds.fill(self, inputs, generate, refill) if ds is not None else generate(inputs)
        if getattr(self, "mismatch", None) is not None:
            self.mismatch.observe(output)
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's, or the mode's own (continuous batching without TRL's cast of the weights, a budget's carried
        groups); then, while training, the mode's next move (a server is asked for the next batch)."""
        mode = self._mode()
        out = mode.single_turn(self, prompt_ids) if mode is not None else None
        if out is None:
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)
        if mode is not None and self.model.training:
            mode.after_single_turn(self, num_generations)
        return out

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers'; where the mode reads the next generation batch one optimizer step early (a server sampling
        ahead, --rollout_budget starting it early), through its ReadAhead."""
        ahead = self._mode().read_ahead if self._mode() is not None else None
        if ahead is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = ahead.read(self, epoch_iterator, num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def _save_checkpoint(self, model, trial):
        """transformers'; the mode's and dynamic sampling's state go in first (--rollout_budget: every rank's rollouts
        in flight; trainer_state.json, written last, completes the checkpoint: carried_rollouts.save_rollouts)."""
        if self._mode() is not None:
            where = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            self._mode().save(self, where)
            if self.dynamic_sampling is not None:
                self.dynamic_sampling.save(where, self.accelerator.is_main_process)
        return super()._save_checkpoint(model, trial)

    def _load_rng_state(self, checkpoint):
        """transformers' (once, when train() resumes from `checkpoint`); the mode's and dynamic sampling's state too."""
        if checkpoint is not None and self._mode() is not None:
            self._mode().load(self, checkpoint)
            if self.dynamic_sampling is not None:
                self.dynamic_sampling.load(checkpoint)
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
        """transformers' (TRL's metrics included); a training step's line also gets the phases' memory, the
        non-finite counters, the generation mode's metrics, the sampler/trainer mismatch (trainer/mismatch.py) and
        share_prompt/token_ratio."""
        if self.model.training and getattr(self, "telemetry", None) is not None:
            logs.update(self.telemetry.pop_metrics())
            if self.nonfinite_guard is not None:
                logs.update(self.nonfinite_guard.metrics())
            logs.update(self.generation_mode.metrics())
            if self.dynamic_sampling is not None:
                logs.update(self.dynamic_sampling.metrics())
            logs.update(self.mismatch.pop_metrics())  # sampler vs trainer: log-prob gap, k3 KL, MoE routing flips
            ratio = self.packed_passes.pop_token_ratio()
            if self.share_prompt != "false" and ratio is not None:
                logs["share_prompt/token_ratio"] = ratio  # 1.0: nothing shared
        super().log(logs, start_time)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's one hook for the policy (with grad), old and reference (no grad) log-probs, through the savers
        (logprob_passes.py: packed rows, the fused head in mini-batches, the SP pass)."""
        if not getattr(self, "savers_installed", False):  # closed (after train()), or made without our __init__
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        correction = self.kept_mass_correction
        with self._phase("policy_forward" if torch.is_grad_enabled() else "logps_no_grad"):
            if correction is not None and correction.pending and not torch.is_grad_enabled():  # TRL's old pass
                return correction.old_pass(lambda truncation: logps_and_entropies(
                    self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                    compute_aux_loss, truncation=truncation, **multimodal))
            return logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                       compute_entropy, compute_aux_loss, **multimodal)
