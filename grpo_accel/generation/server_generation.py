"""Generation on a `vllm serve` machine for a LoRA run: adapter-only sync over HTTP, and with `max_staleness >= 1`
the next generation batch sampled while this one trains (issue 52; docs/off-policy-rollouts.md).

TRL 1.16 drives generation through two methods of `trainer.vllm_generation` (grpo_trainer._generate_single_turn):
`sync_weights()` when the optimizer step changed, then `generate(prompts=..., num_generations=...)`, whose per-token
log-probs TRL's importance-sampling correction divides by. This object is that pair for a server:

- `sync_weights()`: every `weight_sync_steps` optimizer steps, the adapter (MBs: the base never moves, no merge, no
  NCCL) is written where the server reads it and loaded as `policy-<run>-v{step}` (adapter_sync.AdapterSync). Under
  ZeRO-3 every rank joins the gather of the adapter's shards; rank 0 writes and loads it.
- `generate(...)`: the batch's groups, each carrying the version that sampled it and its behaviour log-probs
  (server_rollouts.sample_groups). With `max_staleness >= 1` they were requested one step earlier by `submit` (the
  trainer's look-ahead, trainer.py) and sampled with that step's adapter while the trainer trained: the server and
  the trainer overlap, and TRL's correction covers the one version between them. A batch whose version is more than
  `max_staleness` steps old, or that is not the batch the trainer now asks for (an epoch's end, a resume), is
  dropped, counted, and sampled again with the current adapter: a whole batch shares one version, so dropping
  removes no length more than another. `max_staleness=0`: synchronous server mode, nothing requested ahead.

Only rank 0 talks to the server; the others wait for its answer in a broadcast, which carries rank 0's error too: a
dead, slow or refusing server stops every rank with the same `error:` line within `vllm_server_timeout`.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from grpo_accel.core.errors import UserError
from grpo_accel.generation.adapter_sync import AdapterSync
from grpo_accel.generation.rollouts import RolloutGroup, within_staleness
from grpo_accel.generation.server_rollouts import sample_groups


@dataclass
class _BatchAsked:
    """A batch asked for ahead: its unique prompts (one per group), the version that samples it, the answer."""

    prompts: list[list[int]]
    version: int
    future: Future


def _adapter_gathered(model):
    """The adapter's parameters whole on every rank for the length of the block: under ZeRO-3 (parameters carrying
    `ds_id`) DeepSpeed's gather, which every rank must join; otherwise nothing to do."""
    params = [p for p in model.parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


class ServerGeneration:
    """TRL's `vllm_generation` for `vllm_mode="server"` with a PEFT adapter (see the module docstring).

    `accelerator` gives the ranks; `policy()` the unwrapped PEFT model; `step()` the trainer's optimizer step (the
    policy version); `training()` whether the trainer is training (an evaluation's batches are sampled at once and
    leave the batch asked ahead for the next step alone). `sampling`: temperature, top_p, top_k, min_p,
    repetition_penalty as TRL's config has them. `adapter_dtype`: the dtype of the adapter files (AdapterSync's
    `dtype`; None: the adapter's own)."""

    def __init__(self, accelerator, policy, step, *, base_url: str, sync_dir: str | Path, max_completion_length: int,
                 sampling: dict, max_staleness: int = 1, weight_sync_steps: int = 1, timeout_s: float = 240.0,
                 api_key: str | None = None, training=lambda: True, adapter_dtype=None):
        if max_staleness < 0 or weight_sync_steps < 1:
            raise ValueError(f"max_staleness {max_staleness} >= 0 and weight_sync_steps {weight_sync_steps} >= 1")
        self.accelerator, self.policy, self.step, self.training = accelerator, policy, step, training
        self.base_url, self.max_completion_length, self.sampling = base_url.rstrip("/"), max_completion_length, sampling
        self.max_staleness, self.weight_sync_steps, self.timeout_s = max_staleness, weight_sync_steps, timeout_s
        # the server keeps the version just loaded and those still sampling for a step ahead
        self.sync = AdapterSync(base_url, sync_dir, keep=max_staleness + 1, timeout_s=timeout_s, api_key=api_key,
                                dtype=adapter_dtype)
        self.version: int | None = None  # the optimizer step of the adapter the server holds
        self.requests: deque[_BatchAsked] = deque()  # rank 0's batches asked for ahead, oldest first
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-accel-server") \
            if accelerator.is_main_process else None
        self._group_id = 0
        self._now = False  # sampled_now(): generate leaves the batches asked for ahead queued
        self.stats = {"batches": 0, "ahead": 0, "dropped_batches": 0, "dropped_completion_tokens": 0,
                      "staleness_sum": 0, "wait_s": 0.0, "sync_s": 0.0}

    # ---------------------------------------------------------------------------------------------- rank 0's answer
    def _on_main(self, fn):
        """fn() on rank 0, its result (or its error) broadcast to every rank: one error line on each, no rank left
        waiting in a collective when rank 0 failed."""
        result, error, failure = None, None, None
        if self.accelerator.is_main_process:
            try:
                result = fn()
            except UserError as exc:
                error, failure = ("user", str(exc)), exc
            except BaseException as exc:  # our bug: rank 0 raises it with its traceback, the others name it
                error, failure = ("bug", f"{type(exc).__name__}: {exc}"), exc
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            box = [(result, error)]
            broadcast_object_list(box, from_process=0)
            result, error = box[0]
        if error is not None:
            if failure is not None:
                raise failure
            if error[0] == "user":
                raise UserError(error[1])
            raise RuntimeError(f"rank 0 failed while talking to the vLLM server ({error[1]}): its traceback is in "
                               "rank 0's log")
        return result

    def _gather(self, items: list) -> list:
        if self.accelerator.num_processes == 1:
            return list(items)
        from accelerate.utils import gather_object

        return gather_object(items)

    # ------------------------------------------------------------------------------------------------ TRL's two calls
    def check(self) -> None:
        """Before the first step (every rank): the server answers, takes the key, can load adapters at run time."""
        self._on_main(self.sync.check)

    def sync_weights(self) -> None:
        step = self.step()
        if self.version is not None and step - self.version < self.weight_sync_steps:
            return
        t0 = time.perf_counter()
        model = self.policy()
        with _adapter_gathered(model):  # every rank: ZeRO-3's gather is a collective
            error = None
            if self.accelerator.is_main_process:
                try:
                    self.sync.push(model, step)
                except BaseException as exc:  # raised below on every rank, after the shards are released
                    error = exc
        self._on_main(lambda: _reraise(error))
        self.version = step
        self.stats["sync_s"] += time.perf_counter() - t0

    def generate(self, prompts, images=None, num_generations: int = 1, profiler=None):
        """TRL's tuple (prompt_ids, completion_ids, logprobs, logprob_token_ids) for this rank's `prompts` (each
        repeated num_generations times, as TRL hands them): the batch asked for ahead when it is this one and fresh
        enough, else sampled now."""
        if images is not None and any(i is not None for i in images):
            raise UserError("--vllm_mode server with adapter sync generates from token ids only; images are not sent. "
                            "Fix: a text-only dataset, or full fine-tuning through TRL's own server mode.")
        all_prompts = self._gather(prompts)

        def answer():
            groups = self._take([list(p) for p in all_prompts[::num_generations]], num_generations)
            rows = [(g.prompt_ids, r.completion_ids, r.behaviour_logps) for g in groups for r in g.rollouts]
            return [list(col) for col in zip(*rows)]

        with profiler or contextlib.nullcontext():
            prompt_ids, completion_ids, logps = self._on_main(answer)
        mine = slice(self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts))
        # TRL's shape: per token a list of the top-k log-probs, the sampled token's first (it keeps lp[0])
        return prompt_ids[mine], completion_ids[mine], [[[x] for x in seq] for seq in logps[mine]], None

    @contextlib.contextmanager
    def sampled_now(self):
        """Inside, `generate` samples its prompts now and leaves the batches asked for ahead queued (dynamic
        sampling's refill rounds: prompts nobody asked for ahead, inside a step that has its batch)."""
        self._now = True
        try:
            yield
        finally:
            self._now = False

    def submit(self, prompts, num_generations: int) -> None:
        """Every rank, with its share of the next generation batch (repeated num_generations times, as TRL's
        sampler gives them): rank 0 asks the server for it now, with the adapter it holds; `generate` collects it."""
        all_prompts = self._gather(prompts)
        if self.accelerator.is_main_process and len(self.requests) < self.max_staleness:
            unique = [list(p) for p in all_prompts[::num_generations]]
            self.requests.append(_BatchAsked(unique, self.version, self._pool.submit(
                self._sample, unique, num_generations, self.version)))

    # ------------------------------------------------------------------------------------------------------ rank 0
    def _sample(self, prompts: list[list[int]], num_generations: int, version: int) -> list[RolloutGroup]:
        first, self._group_id = self._group_id, self._group_id + len(prompts)
        return sample_groups(self.base_url, self.sync.name_of(version), version, prompts, num_generations,
                             self.max_completion_length, first_group_id=first, api_key=self.sync.api_key,
                             timeout_s=self.timeout_s, **self.sampling)

    def _take(self, prompts: list[list[int]], num_generations: int) -> list[RolloutGroup]:
        step, t0 = self.step(), time.perf_counter()
        groups = None
        while self.requests and groups is None and self.training() and not self._now:
            req = self.requests.popleft()
            result = req.future.result()  # sample_groups' own timeout bounds it
            if req.prompts == prompts and within_staleness(step - req.version, self.max_staleness):
                groups = result
                self.stats["ahead"] += 1
            else:  # not this batch (an epoch's end, a resume) or too old: dropped whole, counted
                self.stats["dropped_batches"] += 1
                self.stats["dropped_completion_tokens"] += sum(len(r.completion_ids) for g in result
                                                               for r in g.rollouts)
        if groups is None:
            groups = self._pool.submit(self._sample, prompts, num_generations, self.version).result()
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["batches"] += 1
        self.stats["staleness_sum"] += step - groups[0].oldest_version if groups and groups[0].rollouts else 0
        return groups

    def metrics(self) -> dict[str, float]:
        """Since the last call, for the trainer's log (rank 0's; the others report zeros)."""
        s, n = self.stats, max(self.stats["batches"], 1)
        out = {"server/batches_ahead_frac": s["ahead"] / n, "server/staleness": s["staleness_sum"] / n,
               "server/dropped_batches": float(s["dropped_batches"]),
               "server/dropped_completion_tokens": float(s["dropped_completion_tokens"]),
               "server/wait_s": s["wait_s"], "server/sync_s": s["sync_s"],
               "server/sync_bytes_total": float(self.sync.bytes_sent)}
        if s["batches"]:
            for key in s:
                s[key] = 0 if isinstance(s[key], int) else 0.0
        return out

    def close(self) -> None:
        """The batches asked for ahead are dropped: nobody trains on them (one already sampling finishes in the
        background). A later train() asks again."""
        for req in self.requests:
            req.future.cancel()
        self.requests.clear()


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


__all__ = ["ServerGeneration"]
