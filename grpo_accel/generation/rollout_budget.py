"""A step's generation under a decode budget: completions still running when it runs out are carried into the next
step (issue 53's producer of versioned rollouts; the record and its rules are generation/rollouts.py's).

    rollouts = BudgetedRollouts(num_generations=8, budget=256, max_completion_length=4096, max_staleness=1)
    rollouts.add_prompts(prompt_ids, rows)              # this step's new groups (one prompt per group)
    ready, dropped = rollouts.step(n_groups=2, version=step, decode=decode)  # a route's producer, e.g.
    # continuous_batching.paged_decode or vllm_generation.SharedVLLMGeneration.rounds

Why: a synchronous step decodes until its longest completion ends while most of the batch has finished. Here a step
decodes in rounds of at most `budget` tokens per running completion and stops as soon as `n_groups` groups have
all G completions ended (advantages need the whole group); the others keep their tokens and continue next step,
under the next weights, beside the next step's new prompts. The batch a step trains never changes size (TRL splits
and shuffles one generation batch), so a step decodes more rounds when fewer groups are complete, never waits for
the longest completion.

Each token keeps the policy version that sampled it and its behaviour log-prob after temperature and top-k/top-p
(what `decode` returns); a group whose oldest token is more than `max_staleness` versions old is dropped before it
costs another decode round (RolloutBuffer's rule: the bias toward short completions is counted, not assumed).

`decode(sequences, max_new_tokens)` is the route: for each sequence (prompt + the completion so far) and its limit, (new
token ids, their behaviour log-probs, ended by EOS). Continuous batching's (`continuous_batching.paged_decode`) is
transformers' continuous batching with its own log-probs (`return_logprobs`: log-softmax of the processed scores, as
vLLM's processed_logprobs), one manager for all of a step's rounds: inside a step a continued completion gets its pages
back from transformers' prefix cache; carried into the next step it is prefilled again under the new weights (prompt +
partial completion: a prefill, no decode step), rather than its pages held in the pool through the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_accel.generation.rollouts import Rollout, RolloutBuffer, RolloutGroup

# (sequences, max_new_tokens per sequence) -> per sequence (new ids, behaviour log-probs, ended by EOS[, the
# sequence's routing: a route that records a MoE's routing, routing_capture.py])
Decode = Callable[[list[list[int]], list[int]], list[tuple]]


class BudgetedRollouts:
    """The groups in flight on one rank and the rule that decodes them (see the module docstring)."""

    def __init__(self, num_generations: int, budget: int, max_completion_length: int, max_staleness: int = 1):
        if budget < 1 or max_completion_length < 1:
            raise ValueError(f"budget {budget} and max_completion_length {max_completion_length} must be >= 1")
        self.buffer = RolloutBuffer(num_generations, max_staleness)
        self.budget, self.max_completion_length = budget, max_completion_length
        self.next_group_id = 0
        self.ahead: list[list[int]] | None = None  # the prompts of the batch admitted ahead of its step (the caller's)
        self._counted_version = None  # the version whose carried completions are counted (a step may call step twice)
        # decode rounds, and the completions a round ran against the slots it had (a round is as long as its
        # longest member: an idle slot is a completion that ended inside the round or was not running)
        self.stats = {"rounds": 0, "decoded_tokens": 0, "round_slot_tokens": 0, "carried_completions": 0,
                      "prefill_tokens_again": 0}

    def add_prompts(self, prompts: list[list[int]], inputs: list[dict] | None = None) -> list[RolloutGroup]:
        """One new group per prompt, G empty completions each; `inputs` the dataset rows its rewards read."""
        groups = []
        for i, prompt in enumerate(prompts):
            g = RolloutGroup(self.next_group_id, list(prompt), [Rollout() for _ in range(self.buffer.num_generations)],
                             dict(inputs[i]) if inputs else {})
            self.next_group_id += 1
            self.buffer.add(g)
            groups.append(g)
        return groups

    def _complete_within_bound(self, version: int) -> int:
        bound = self.buffer.max_staleness
        return sum(1 for g in self.buffer.groups if g.complete and g.staleness(version) <= bound)

    def step(self, n_groups: int, version: int, decode: Decode) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
        """(ready, dropped): decode rounds under policy `version` until `n_groups` groups are complete, then take
        them oldest first; groups past the staleness bound are dropped first. What still runs is carried."""
        _, dropped = self.buffer.take(0, version)  # too old to correct: dropped before another round is spent on it
        if version != self._counted_version:  # a refill round of the same step carries nothing into it again
            self._counted_version = version
            self.stats["carried_completions"] += sum(1 for g in self.buffer.groups for r in g.rollouts
                                                     if r.completion_ids and not r.finished)
        while self._complete_within_bound(version) < n_groups:
            running = [(g, r) for g in self.buffer.groups for r in g.rollouts if not r.finished]
            if not running:
                break  # every group ended and fewer than n_groups remain: the caller added too few prompts
            sequences = [g.prompt_ids + r.completion_ids for g, r in running]
            limits = [min(self.budget, self.max_completion_length - len(r.completion_ids)) for _, r in running]
            self.stats["prefill_tokens_again"] += sum(len(r.completion_ids) for _, r in running)
            outputs = decode(sequences, limits)
            if len(outputs) != len(running):
                raise RuntimeError(f"decode returned {len(outputs)} completions for {len(running)} sequences")
            for (_, r), limit, (ids, logps, eos, *routing) in zip(running, limits, outputs):
                if len(ids) > limit:
                    raise RuntimeError(f"decode returned {len(ids)} tokens past its limit of {limit}")
                ended = eos or len(r.completion_ids) + len(ids) >= self.max_completion_length
                r.extend(list(ids), list(logps), version, finished=ended, routed_experts=next(iter(routing), None))
            self.stats["rounds"] += 1
            self.stats["decoded_tokens"] += sum(len(o[0]) for o in outputs)
            self.stats["round_slot_tokens"] += len(running) * max((len(o[0]) for o in outputs), default=0)
        ready, too_old = self.buffer.take(n_groups, version)
        return ready, dropped + too_old

    def metrics(self) -> dict[str, float]:
        """For the trainer's log, since the last call: decode rounds, the fraction of decode slots that produced a
        token (1.0: the batch full at every decode step), completions carried into a step, prompt + partial tokens
        submitted again (an upper bound on what is prefilled again: inside a step the prefix cache serves their full
        pages); and, since the start, the groups dropped past the staleness bound and their tokens."""
        s, b = self.stats, self.buffer.stats
        out = {"rollouts/rounds": float(s["rounds"]), "rollouts/carried_completions": float(s["carried_completions"]),
               "rollouts/slot_use": s["decoded_tokens"] / s["round_slot_tokens"] if s["round_slot_tokens"] else 1.0,
               "rollouts/prefill_tokens_again": float(s["prefill_tokens_again"]),
               "rollouts/dropped_groups_total": float(b["dropped_groups"]),
               "rollouts/dropped_completion_tokens_total": float(b["dropped_completion_tokens"]),
               "rollouts/in_flight_groups": float(len(self.buffer.groups))}
        for key in s:
            s[key] = 0
        return out

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "next_group_id": self.next_group_id, "stats": dict(self.stats),
                "budget": self.budget, "max_completion_length": self.max_completion_length, "ahead": self.ahead}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = RolloutBuffer.from_state_dict(state["buffer"])
        self.next_group_id, self.stats, self.ahead = state["next_group_id"], dict(state["stats"]), state["ahead"]


__all__ = ["BudgetedRollouts", "Decode"]
