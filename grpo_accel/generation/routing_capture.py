"""The sampler's own routing on the route `continuous_batching`: each token's top-k experts per MoE layer as the
routers chose them in transformers' continuous batching forwards, the ones that sampled the completion.

    capture = RoutingCapture(replay)                   # replay: head/routing_replay.RoutingReplay, installed
    with capture.on(model):                            # every manager `model` starts inside is recorded
        ... generate_batch / a manager's requests ...
    routing = capture.resolve({request_id: prompt + generated tokens})  # id -> [n tokens, L, k] int16, -1: none

How rows map to tokens: each forward of a manager (its `_generation_step`, wrapped per instance) runs the requests of
its batch processor's `requests_in_batch` in order, `query_length` tokens each starting at the request's position
before the forward (prefill chunks and decode steps alike), so router row r belongs to the request whose span holds r;
rows past the spans are padding (CUDA graphs' static shapes). What a request did not compute itself is filled from a
request of the same manager that computed the same prefix, under the same weights: a fork's prompt (transformers
prefills a group's prompt once and forks it) and a prefix-cache hit (full pages of a prompt, or of a budget round's
partial completion, served from an earlier request). The last token of a sequence is never fed to the model: -1
there (RoutingRecords: the trainer keeps its own top-k for it).

Cost: the routers' top-k, int16 [tokens, L, k] on the device until the batch ends (L x k x 2 bytes a token: Qwen3-30B-
A3B, 48 x 8 x 2 = 768 B); one Python pass over every token to hash its prefix (about a microsecond a token); CUDA graphs
off while recording (a replayed graph would skip the recording, which is Python).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch

from grpo_accel.core.patches import Patches, set_attr


def prefix_hashes(tokens: list[int]) -> list[int]:
    """h[p]: a hash of tokens[:p + 1] (a chain, one step per token). Two sequences agreeing up to p share h[p]; a
    64-bit collision between prefixes of one batch (about n^2 / 2^64) is the cost of not keying by whole prefixes."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def _host_io(io):
    """The batch processor's host inputs of the forward about to run (its one set, or async batching's current pair)."""
    pairs = getattr(io, "io_pairs", None)
    return io if pairs is None else pairs[io.current_pair].host_io


class RoutingCapture:
    """The routing a manager's forwards computed (`steps`: per forward, its request spans and its router rows) and
    what `resolve` made of it (`routing`: request id -> [n, L, k] int16, each position the request computed itself;
    `sources`: prefix hash -> (request id, position) of a computed one)."""

    def __init__(self, replay):
        self.replay = replay
        self.steps: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []
        self.routing: dict[str, torch.Tensor] = {}
        self.sources: dict[int, tuple[str, int]] = {}
        self.last: list[torch.Tensor] | None = None  # generate_paged's completions' routing, in their order

    @staticmethod
    def config(cb_config):
        """`cb_config` with CUDA graphs off: a replayed graph runs no Python, so the recording would be empty."""
        cfg = copy.deepcopy(cb_config)
        cfg.use_cuda_graph = False
        return cfg

    @contextlib.contextmanager
    def on(self, model):
        """Inside: every continuous batching manager `model` starts records each forward's routing here."""
        original = model.init_continuous_batching

        @functools.wraps(original)
        def init(*args, **kwargs):
            manager = original(*args, **kwargs)
            set_attr(manager, "_generation_step", self._step(manager, manager._generation_step))
            return manager

        patches = Patches()
        patches.add(set_attr(model, "init_continuous_batching", init))
        try:
            yield self
        finally:
            patches.undo()

    def _step(self, manager, original):
        def step():
            io = manager.batch_processor.inputs_and_outputs
            # position_offset already counts this forward's tokens (prepare_batch_tensors ran)
            spans = [(f.state.request_id, f.state.position_offset - f.query_length, f.query_length)
                     for f in _host_io(io).requests_in_batch]
            with self.replay.recording() as calls:
                original()
            total = sum(n for _, _, n in spans)
            stream = getattr(io, "compute_stream", None)  # the forward's stream: its rows are written there
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                rows = torch.stack([calls[n][0][:total] for n in sorted(calls)], dim=1).to(torch.int16)
            self.steps.append((spans, rows))

        return step

    def resolve(self, sequences: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Request id -> [len(tokens), L, k] int16 for each of `sequences` (id -> prompt + generated tokens): the
        request's own routing, else another request's at the same prefix, else -1 (see the module docstring).
        Earlier calls' sequences stay known: a later round's request finds the pages an earlier round computed."""
        if self.steps and self.steps[0][1].is_cuda:
            torch.cuda.synchronize()  # the last forwards' rows may still be in flight on their stream
        shape = next((rows.shape[1:] for _, rows in self.steps), None)
        for spans, rows in self.steps:
            rows, offset = rows.cpu(), 0
            for rid, start, n in spans:
                if rid in sequences and rid not in self.routing:
                    self.routing[rid] = torch.full((len(sequences[rid]), *shape), -1, dtype=torch.int16)
                if rid in self.routing:
                    self.routing[rid][start:start + n] = rows[offset:offset + n]
                offset += n
        self.steps = [(spans, rows) for spans, rows in self.steps if any(r not in sequences for r, _, _ in spans)]
        hashes = {rid: prefix_hashes(tokens) for rid, tokens in sequences.items()}
        for rid, h in hashes.items():
            computed = (self.routing[rid][:, 0, 0] >= 0).tolist() if rid in self.routing else []
            for p, done in enumerate(computed):
                if done:
                    self.sources.setdefault(h[p], (rid, p))
        return {rid: self._filled(rid, tokens, hashes[rid], shape) for rid, tokens in sequences.items()}

    def _filled(self, rid: str, tokens: list[int], hashes: list[int], shape) -> torch.Tensor:
        own = self.routing.get(rid)
        if own is None:  # not one forward of this request (served whole from the cache): all from others
            own = torch.full((len(tokens), *shape), -1, dtype=torch.int16) if shape else None
        if own is None:
            return torch.empty(0)
        out = own.clone()
        for p in (own[:, 0, 0] < 0).nonzero().flatten().tolist():
            src = self.sources.get(hashes[p])
            if src is not None:
                out[p] = self.routing[src[0]][src[1]]
        return out


__all__ = ["RoutingCapture", "prefix_hashes"]
