"""Route `continuous_batching`: transformers' continuous batching (`generate_batch`, a paged KV cache) generating
from the trainer's own model, its weights as they train, the page pool sized by the planner.

    cfg, line = paged_config(model, generation_batch=16, prompt_tokens=512, completion_tokens=4096)
    completions = generate_paged(model, prompt_ids, generation_config, cfg)

Why not TRL 1.16's branch as it stands (`use_transformers_continuous_batching`): it calls
`unwrapped_model.to(torch.bfloat16)` before generating, which casts a LoRA adapter's fp32 weights to bf16 in place
and for good (tests/test_continuous_batching.py shows it on TRL's trainer), and it leaves transformers to size the
pool from a fraction of free memory (on CPU: of the host's RAM, 36 s to set up for a 3M-parameter model). Here the
weights keep their dtype (PEFT casts a layer's input to its adapter's dtype, as in training), and `num_blocks` comes
from the plan (planning.generation.paged_num_blocks): the pool holds `paged_seqs` full-length sequences at once, the
rest of the generation batch waits in transformers' queue.

Attention: transformers' paged path accepts only sdpa, eager (as paged|eager) and flash implementations and refuses
any other name ("Implementation grpo_accel_sdpa is not supported for continuous batching"). Packing's registration
(parallel/packing.py) routes unpacked calls to stock SDPA anyway, so for generation the model steps back to the
implementation packing replaced (`stock_attention`) and returns to the packed one after.

A group's prompt is prefilled once and its pages stored once: TRL's sampler lays a prompt's G copies side by side,
and generate_paged submits each prompt once with num_return_sequences = G instead (sampling only: transformers refuses
G > 1 for greedy decoding). transformers prefills the prompt but its last token, forks the G - 1 others, and with
`allow_block_sharing` (its default) the forks share the prompt's full pages and copy the partial one: pages in use
(planning.generation.paged_pages) 30 instead of 72 for 8 x (200 + 64) tokens, counted in transformers' allocator by
tests/test_continuous_batching.py. The pool is still sized for whole copies: on the SDPA path one forward reads back
at most the pool's tokens, so a smaller pool would serve the group in rounds (planning.generation.paged_pool_bytes).
Submitted as G separate requests, as TRL's branch does, the copies are prefilled G times and deduplicated only
after the forward that fills a page (cache_allocator.mark_complete_blocks). With `allow_block_sharing: False` in the
run's transformers_continuous_batching_config, the prompts go as TRL's do.

Behaviour log-probs: none are returned, as TRL's branch returns none, and none are needed: the sampling policy is
the trained policy itself (the same tensors, the same dtype), so TRL's importance-sampling correction, which exists
for an engine holding another copy of the weights (vLLM), would correct nothing but kernel rounding.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math

import torch

from grpo_accel.core.patches import Patches, set_attr
from grpo_accel.parallel.packing import ATTN_NAME, UNPACKED_ATTN
from grpo_accel.planning.generation import PAGE_SIZE, PAGED_BATCH_TOKENS, kv_bytes_per_token, paged_num_blocks
from grpo_accel.planning.routes import PAGED_TRANSFORMERS


def continuous_batching_missing() -> str | None:
    """Why this transformers cannot run the route (None: it can), naming the fix."""
    try:
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        import transformers

        return (f"transformers {transformers.__version__} has no continuous batching. Fix: "
                f"pip install 'transformers>={PAGED_TRANSFORMERS}'")
    return None


@contextlib.contextmanager
def stock_attention(model):
    """Inside: every config of `model` that packing pointed at its attention function (parallel/packing.py) names the
    implementation it replaced again (sdpa; gpt-oss's eager), which transformers' paged path accepts; after: back."""
    undo = Patches()
    configs = {id(c): c for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "get_text_config")
               for c in (m.config, m.config.get_text_config())}
    for cfg in configs.values():
        if getattr(cfg, "_attn_implementation", None) == ATTN_NAME:
            undo.add(set_attr(cfg, "_attn_implementation", getattr(cfg, UNPACKED_ATTN, "sdpa")))
    try:
        yield
    finally:
        undo.undo()


def prompt_group(prompt_ids: list[list[int]]) -> int:
    """G: how many copies of each prompt stand side by side (TRL's sampler lays a group's G copies together), the
    gcd of the runs of equal prompts; 1 where a prompt has fewer than 2 tokens (transformers forks after prefilling
    all but the last token, so it needs one before it)."""
    if not prompt_ids or min(map(len, prompt_ids)) < 2:
        return 1
    return math.gcd(*(len(list(run)) for _, run in itertools.groupby(map(tuple, prompt_ids))))


def paged_config(model, *, generation_batch: int, prompt_tokens: int, completion_tokens: int,
                 paged_seqs: int | None = None, user: dict | None = None, page_size: int = PAGE_SIZE):
    """(ContinuousBatchingConfig, one line saying its size) for `paged_seqs` (None: the whole generation batch)
    sequences of prompt + completion tokens at once. `user`: the run's transformers_continuous_batching_config; a
    num_blocks / page_size / max_batch_tokens / allow_block_sharing given there wins over the plan."""
    from transformers.generation import ContinuousBatchingConfig

    from grpo_accel.planning.architectures import model_shape

    user = dict(user or {})
    page_size = int(user.pop("page_size", page_size))
    seqs = max(1, min(paged_seqs or generation_batch, generation_batch))
    T = prompt_tokens + completion_tokens
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    a = 2 if dtype in (torch.bfloat16, torch.float16) else dtype.itemsize  # the cache's dtype (the model's)
    shape = model_shape(model.config)
    planned = paged_num_blocks(shape, a, seqs, T, page_size)
    num_blocks = int(user.pop("num_blocks", planned))
    # the whole pool is the plan; transformers' own check against a fraction of free memory would only shrink it
    cfg = {"max_batch_tokens": PAGED_BATCH_TOKENS, "max_memory_percent": 1.0, **user}
    line = (f"page pool {num_blocks} pages x {page_size} tokens x {kv_bytes_per_token(shape, a) / 1024:.0f} "
            f"KiB/token = {num_blocks * page_size * kv_bytes_per_token(shape, a) / 2**20:.0f} MiB: {seqs} of "
            f"{generation_batch} sequences of {T} tokens at once" + ("" if num_blocks == planned else
                                                                      " (num_blocks as given)"))
    return ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size, **cfg), line


@contextlib.contextmanager
def all_at_once(manager):
    """`with all_at_once(manager): manager.add_request(...)...`: the requests go in while the loop thread is paused,
    so it takes them in one drain of its queue. Why: the loop drains whatever is queued whenever it wakes, and each
    add_request wakes it; a loop that took a round's first request before the rest were queued decoded them in other
    forwards, with other draws of the RNG both threads share (torch.multinomial on the default generator), and a
    seeded run sampled other completions on a loaded machine (tests/test_continuous_batching.py forces it). What it
    costs: one pause of the loop per round, before any of the round's work."""
    with manager.pause():
        yield


def _init_paused(model):
    """model.init_continuous_batching for one generate_batch call: the manager it returns queues a batch's requests
    all at once (generate_batch starts the loop, then adds them one by one)."""
    init = model.init_continuous_batching

    @functools.wraps(init)
    def init_paused(*args, **kwargs):
        manager = init(*args, **kwargs)
        add_requests = manager.add_requests

        @functools.wraps(add_requests)
        def add_paused(*a, **k):
            with all_at_once(manager):
                return add_requests(*a, **k)

        manager.add_requests = add_paused
        return manager

    return set_attr(model, "init_continuous_batching", init_paused)


def generate_paged(model, prompt_ids: list[list[int]], generation_config, cb_config, capture=None) -> list[list[int]]:
    """The completion token ids of each prompt (in order, `generation_config.num_return_sequences` per prompt as
    generate_batch returns them), generated by `model` as it is: no dtype cast, packing's attention stepped aside.
    Side-by-side copies of a prompt go once with num_return_sequences multiplied (see the module docstring) when
    sampling with block sharing allowed; generate_batch returns a prompt's completions together, so the order holds.
    `capture` (routing_capture.RoutingCapture): the routers' choices recorded, `capture.last` each completion's
    [prompt + completion tokens, L, k] in the same order."""
    returns = getattr(generation_config, "num_return_sequences", None) or 1
    group = prompt_group(prompt_ids) if (getattr(cb_config, "allow_block_sharing", False)
                                         and getattr(generation_config, "do_sample", False)) else 1
    if group > 1:
        generation_config = copy.deepcopy(generation_config)
        generation_config.num_return_sequences = returns * group
    recording = capture.on(model) if capture is not None else contextlib.nullcontext()
    cb_config = capture.config(cb_config) if capture is not None else cb_config
    undo = _init_paused(model)
    try:
        with stock_attention(model), torch.no_grad(), recording:
            outputs = model.generate_batch(prompt_ids[::group], generation_config=generation_config,
                                           continuous_batching_config=cb_config, progress_bar=False)
    finally:
        undo()
    # generate_batch logs a failed or lost request and returns the others: fewer completions than prompts would
    # pair rewards with the wrong rows downstream, so a short or failed batch stops here
    expected = len(prompt_ids) * returns
    failed = [k for k, o in outputs.items() if getattr(o, "error", None) is not None]
    if len(outputs) != expected or failed:
        raise RuntimeError(f"transformers' generate_batch returned {len(outputs)} of {expected} completions "
                           f"({len(failed)} failed: {[outputs[k].error for k in failed][:3]}); its log says why")
    if capture is not None:
        routing = capture.resolve({k: list(o.prompt_ids) + list(o.generated_tokens) for k, o in outputs.items()})
        capture.last = [routing[k] for k in outputs]
    return [list(o.generated_tokens) for o in outputs.values()]


# Pages of a budgeted step's pool: a continued sequence gets back its full pages, so at most ROUND_PAGE_SIZE - 1 of
# its tokens are prefilled again per round (transformers' default is 256: a whole completion of the demo's length).
ROUND_PAGE_SIZE = 16


def _finished(manager, ids: list) -> dict:
    """{request id: its finished result} for every id. No bound on a round's time (a round of a long budget on a large
    model may take many minutes): a generation thread that stopped is what ends the wait; a hung one is the run's
    hang handling's (SIGUSR1 prints stacks)."""
    done: dict = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError(f"transformers' continuous batching returned {len(done)} of {len(ids)} continuations: "
                               "its generation thread stopped; its log says why")
    failed = [o.error for o in done.values() if getattr(o, "error", None) is not None]
    if failed:
        raise RuntimeError(f"transformers' continuous batching failed {len(failed)} continuation(s): {failed[:3]}")
    return done


@contextlib.contextmanager
def paged_decode(model, generation_config, cb_config=None, capture=None):
    """`with paged_decode(model, generation_config, cb_config) as decode:` the route `continuous_batching`'s producer:
    transformers' continuous batching with its own log-probs (`return_logprobs`), one manager for every round of a
    step, each sequence with its own limit. EOS: the generation config's eos_token_id(s). `capture`
    (routing_capture.RoutingCapture): each result has a fourth item, the routing of the sequence and its new tokens
    ([n + new, L, k] int16, -1 where none: the last token).

    Why not `generate_batch` per round: each call starts a manager and its thread, and its teardown runs
    `gc.collect()` twice (0.36 s in a bare process, more in a trainer's); a budgeted step runs several rounds, and
    sequences near the completion limit have other limits than the budget (one call each). One manager per step pays
    that once, as the unbudgeted route's one `generate_batch` does. The weights do not change inside a step, so the
    pages a round wrote stay valid for the next: transformers' prefix cache (`allow_block_sharing`, its hashes of full
    pages) hands a continued sequence its full pages back, and only the tokens past its last full page are prefilled
    again (what that saves: 44067c6 measured it). A new step's manager starts empty: its rounds prefill the carried
    tokens under the new weights, as they must."""
    import torch
    from transformers.generation import ContinuousBatchingConfig

    eos = generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    gen = copy.deepcopy(generation_config)
    gen.num_return_sequences = 1
    cfg = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    cfg.return_logprobs = True
    cfg.allow_block_sharing = True  # a round's prompt + partial completion finds its full pages from the round before
    recording = capture.on(model) if capture is not None else contextlib.nullcontext()
    cfg = capture.config(cfg) if capture is not None else cfg
    with stock_attention(model), torch.no_grad(), recording:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        manager.start()

        def decode(sequences: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float], bool]]:
            with all_at_once(manager):
                ids = [manager.add_request(list(seq), max_new_tokens=limit) for seq, limit in zip(sequences, limits)]
            done = _finished(manager, ids)
            out = []
            for i in ids:
                tokens = list(done[i].generated_tokens)
                out.append((tokens, [float(x) for x in done[i].logprobs], bool(tokens) and tokens[-1] in eos))
            if capture is not None:
                routing = capture.resolve({i: list(seq) + out[n][0] for n, (i, seq) in enumerate(zip(ids, sequences))})
                out = [(*o, routing[i]) for o, i in zip(out, ids)]
            return out

        try:
            yield decode
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()


__all__ = ["ROUND_PAGE_SIZE", "all_at_once", "continuous_batching_missing", "generate_paged", "paged_config",
           "paged_decode", "prompt_group", "stock_attention"]
