"""The memory savers' installers, as methods of GRPOAccelTrainer (a mixin: the trainer owns what they set).

Each saver that patches a model or a process-wide registry keeps its undo in `self.patches` (core/patches.py):
`GRPOAccelTrainer.close()` (run when train() ends, however it ends) leaves the models and transformers' registries
as they were. What they set on the trainer, read by the log-prob passes (logprob_passes.py): `settings` (the config's
settings as they run on this device), `offload_config` / `offload_enabled`, `logprob_impl`, `sequence_parallel`,
`padding_free`, `share_prompt`, `packed_passes` (the packed passes' counts), `routing_replay` / `routing_records` (a
MoE's routers and the generation batch's recorded routing), `savers_installed`.
"""

from __future__ import annotations

import os
import warnings

import torch

from grpo_accel.core.console import log
from grpo_accel.core.errors import ConfigError
from grpo_accel.core.model_access import causal_lm_of
from grpo_accel.core.settings import (
    SHARE_PROMPT_MIN_SAVED,
    RunSettings,
    share_prompt_blocker,
    share_prompt_pays,
    shared_group_tokens,
)
from grpo_accel.head.logprob_head import head_unsupported_reason, install_logprob_head
from grpo_accel.head.routing_replay import RoutingRecords, RoutingReplay
from grpo_accel.offload import OffloadConfig, install_activation_offload, remove_activation_offload
from grpo_accel.offload.residency import host_budget_per_process
from grpo_accel.ops.select import triton_usable
from grpo_accel.parallel.packing import ATTN_NAME, enable_packed_attention, packing_unsupported_reason
from grpo_accel.planning.memory import shortest_shared_prompt
from grpo_accel.trainer.logprob_passes import PackedPasses
from grpo_accel.trainer.mismatch import MismatchMeter

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


class SaverInstallers:
    """GRPOAccelTrainer's saver installers (module docstring)."""

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
        self.packed_passes = PackedPasses()  # the packed passes' token counts (share_prompt/token_ratio)
        self.routing_replay, self.routing_records = self._install_routing_replay()
        self.mismatch = MismatchMeter(self.routing_replay, self.routing_records)
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

    def _install_routing_replay(self):
        """(RoutingReplay, RoutingRecords) on a MoE model whose routers head/routing_replay.py knows, else (None,
        None); "false" only measures (the passes route by the trainer's own top-k). Replay is not built yet beside
        the offloaded re-run (its sequence tiles run the MLP outside the layer's call) nor Ulysses shards (each rank
        would need its shard of the record): "auto" steps aside there with one line, "true" is refused."""
        mode = self.settings.routing_replay
        causal_lm = causal_lm_of(self.model)
        reason = RoutingReplay.unsupported_reason(causal_lm)
        if reason == "a dense model routes nothing":
            return None, None
        blocker = getattr(getattr(self, "generation_mode", None), "routing_blocker", None)
        if reason is None and blocker is not None:  # no record to replay or measure
            if mode == "true":
                raise ConfigError(f"--routing_replay true cannot run: {blocker}. Fix: that, or --routing_replay auto")
            if mode == "auto":
                log(f"routing_replay=auto: off ({blocker})")
            return None, None
        if reason is None and mode != "false":
            reason = ("the offloaded re-run" if self.offload_enabled else
                      "sequence parallelism" if self.sequence_parallel is not None else None)
            if reason and mode == "true":
                raise ConfigError(f"--routing_replay true cannot run with {reason}. Fix: --routing_replay false")
        if reason:
            log(f"routing_replay={mode}: off ({reason})")
            return None, None
        replay = RoutingReplay(causal_lm, replaying=mode != "false")
        self.patches.add(replay.install().undo)
        return replay, RoutingRecords()

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
