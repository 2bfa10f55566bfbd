"""What generation holds on the device, by route (planning.routes): a colocated vLLM engine's KV cache and runtime,
transformers' generate() cache and working set, continuous batching's page pool and working set; and
the engine's share of the GPU sized from a plan (its gpu_memory_utilization, the full-length sequences its KV
cache then holds). The engine's own weights are weights:
memory.py prices them with the trainer's. memory.py imports this module, so `plan` here (a memory.MemoryPlan) is
not imported: a circle the architecture test refuses.
"""

from __future__ import annotations

from grpo_accel.core.dtypes import dtype_bytes
from grpo_accel.core.units import GIB
from grpo_accel.planning.architectures import ModelShape
from grpo_accel.planning.routes import COLOCATED

# vLLM's own working memory besides weights and KV cache (CUDA graphs, sampler, prefill activations): assumed.
VLLM_RUNTIME_BYTES = 1 * GIB
# Alive only while generating: a sleeping engine's KV cache and runtime, and everything generate() holds (its cache
# is freed when the batch is done; the caching allocator then reuses those blocks for the training step).
GENERATION_TERMS = ("vllm_kv_cache", "vllm_runtime", "generate_kv_cache", "generate_working_set", "paged_kv_cache",
                    "paged_working_set", "sampling_rounds")
# Continuous batching (route continuous_batching): transformers' default page size, and the tokens one forward takes
# (decode rows plus prefill chunks), which we fix: SDPA's mask is [tokens, pool + tokens], so it scales with both.
PAGE_SIZE = 256
PAGED_BATCH_TOKENS = 512
TRASH_PAGES = 2  # transformers' paged cache keeps two never-allocated pages (sectors) before the pool


def kv_bytes_per_token(shape: ModelShape, a: int) -> int:
    """K and V of every layer per token: exact without sliding layers, an upper bound with them
    (`ModelShape.kv_cache_bytes` keeps a sliding layer's window only)."""
    return 2 * shape.layers * shape.kv_dim * a


def _generate_terms(shape: ModelShape, a: int, seqs: int, prompt: int, T: int) -> tuple[float, float]:
    """(KV cache, working set) of transformers' generate() over `seqs` sequences of T tokens, as TRL's non-vLLM path
    calls it (the whole generation batch in one call, padded to the longest prompt, DynamicCache).
    Working set: the decode step's growing cache (torch.cat writes one layer's K and V anew beside the old ones),
    the sampler's fp32 logits, processed scores and probabilities [seqs, V], and the prefill of one layer (K and V
    repeated to every head for SDPA with a mask, q, the MLP's gate/up and output)."""
    kv = seqs * shape.kv_cache_bytes(T, a)  # a sliding layer's cache holds its window only
    one_layer_kv = seqs * T * kv_bytes_per_token(shape, a) / shape.layers
    sampler = 3 * seqs * shape.vocab * 4
    prefill = seqs * prompt * (shape.q_dim + 2 * shape.heads * shape.head_dim + 2 * shape.intermediate
                               + shape.hidden) * a
    return kv, one_layer_kv + sampler + prefill


def pages_per_sequence(T: int, page_size: int = PAGE_SIZE) -> int:
    return -(-T // page_size)


def shared_prompt_pages(prompt: int, page_size: int = PAGE_SIZE) -> int:
    """Pages of a `prompt`-token prompt its group's sequences share. transformers prefills all but the prompt's last
    token, then forks the G - 1 others (scheduler._schedule_request: `token_budget = len(request_tokens) - 1`), and a
    fork shares the pages full at that point and copies the partial one (cache_allocator.count_shareable_blocks:
    `past_length // tokens_per_page`): (prompt - 1) // page_size."""
    return max(0, prompt - 1) // page_size


def paged_pages(seqs: int, T: int, page_size: int = PAGE_SIZE, prompt: int = 0, group: int = 1,
                batch: int | None = None) -> int:
    """Full-attention pages in use for `seqs` sequences of T tokens at once (the pool's size is `paged_pool_bytes`,
    which says why it holds whole copies). `group` > 1: each prompt generates
    `group` sequences forked from one prefill (block sharing on), its full pages stored once per group in flight
    (at most min(seqs, batch / group) groups: a `batch`-sequence generation batch; None: `seqs`), and each sequence
    its own pages from the partial last prompt page on: at most 1 + ceil(completion / page_size) (exactly that when
    the completion is a multiple of the page size), whatever the prompt's length up to `prompt`."""
    whole = seqs * pages_per_sequence(T, page_size)
    shared = shared_prompt_pages(prompt, page_size) if group > 1 else 0
    if not shared:
        return whole
    groups = min(seqs, -(-(batch or seqs) // group))
    own = min(pages_per_sequence(T, page_size), 1 + pages_per_sequence(T - prompt, page_size))
    return min(whole, groups * shared + seqs * own)


def paged_pool_bytes(shape: ModelShape, a: int, seqs: int, T: int, page_size: int = PAGE_SIZE) -> int:
    """The page pool that holds `seqs` sequences of T tokens at once, whole pages each (a sliding layer's pages
    cover its window only), plus the two trash pages transformers keeps.

    A group's shared prompt pages (`paged_pages`) are not taken off: on the index path (SDPA, eager) one forward
    reads back at most the pool's tokens (scheduler._process_candidates skips a request once `cache_budget`,
    cache.max_tokens_read = the pool's tokens, cannot cover its length), shared pages read once per sequence. A
    pool sized to the shared pages holds every sequence but serves only pool / T of them per forward: 161
    forwards instead of 65 for 8 x 264 tokens (tests/test_continuous_batching.py). Sharing saves prefills there,
    not memory; the block-table decode path (flash) has no such budget, unmeasured here."""
    tokens = pages_per_sequence(T, page_size) * page_size
    return seqs * shape.kv_cache_bytes(tokens, a) + TRASH_PAGES * page_size * kv_bytes_per_token(shape, a)


def paged_num_blocks(shape: ModelShape, a: int, seqs: int, T: int, page_size: int = PAGE_SIZE) -> int:
    """ContinuousBatchingConfig.num_blocks for that pool: transformers counts the pool in whole-model blocks
    (page_size tokens of every layer's K and V), so this is the pool's bytes over one block's, the trash pages off."""
    block = page_size * kv_bytes_per_token(shape, a)
    return -(-(paged_pool_bytes(shape, a, seqs, T, page_size) - TRASH_PAGES * block) // block)


def fork_copy_bytes(shape: ModelShape, a: int, seqs: int, page_size: int = PAGE_SIZE,
                    batch_tokens: int = PAGED_BATCH_TOKENS, prompt: int = 0, group: int = 1,
                    batch: int | None = None) -> int:
    """The transient of transformers' page copy when groups fork (generate_paged sends a sampled group's prompt once
    with num_return_sequences = G): after the forward that prefilled all but a prompt's last token, each fork gets a
    copy of every page it cannot share, and the copies of all forks of that step go in one index_select of whole
    blocks (one page of every layer of an allocator kind), one kind after the other, in chunks of at most 1 GiB
    (continuous_api: perform_cache_copy; cache_allocator.copy_blocks). Full-attention layers share the full pages
    and copy the partial one (none when prompt - 1 is a multiple of the page); sliding layers share nothing
    (SlidingAttentionCacheAllocator.supports_block_sharing) and copy their window's pages. Groups forking in one step:
    those whose prefill ends in it, at most 1 + batch_tokens // (prompt - 1), and no more than the batch holds (None:
    `seqs` sequences). Counted for any group > 1: with allow_block_sharing off or greedy decoding nothing forks, and
    the plan is over by this term. Measured: 7 forks of a 128-token prompt in 256-token pages of SmolLM2-135M fp32
    copy 78.8 MiB at once, 40% of that generation's peak (benchmarks/bench_continuous_batching.py, where the plan
    had missed it)."""
    past = prompt - 1
    if group <= 1 or past < 1:
        return 0
    groups = min(-(-(batch or seqs) // group), 1 + batch_tokens // past)
    kinds = [(shape.layers - shape.sliding_layers, 1 if past % page_size else 0),
             (shape.sliding_layers, pages_per_sequence(min(past, shape.sliding_window or past), page_size))]
    biggest = 0
    for layers, pages in kinds:
        block = page_size * 2 * layers * shape.kv_dim * a
        if not (block and pages):
            continue
        copies = groups * (group - 1) * pages
        biggest = max(biggest, min(copies, max(1, (1 << 30) // block)) * block)
    return biggest


def _paged_terms(shape: ModelShape, a: int, seqs: int, T: int, page_size: int = PAGE_SIZE,
                 batch_tokens: int = PAGED_BATCH_TOKENS, prompt: int = 0, group: int = 1,
                 batch: int | None = None) -> tuple[float, float]:
    """(page pool, working set) of transformers' continuous batching holding `seqs` sequences of T tokens at once.

    Working set: what lives through the whole call, plus the largest of what one forward step holds at a time.
    Whole call (input_outputs._setup_static_tensors): the SDPA mask [M, read + M] in the model's dtype per attention
    kind, `read` the pool's tokens without the trash pages (cache.max_tokens_read), and the int64 read and write
    indices [read + M] and [M] per kind (one row each, not one per query token), and the small int32 inputs and
    outputs (7 rows of M + 1 and up to 3 for the logits processors' arguments, 128-byte aligned; 2 output rows with
    log-probs). Async double-buffering (transformers' default only on the flash path with CUDA graphs, where no mask
    is allocated) doubles the indices, far less than the mask counted here. One forward of at most
    min(M, seqs x prompt) tokens (decode rows take one, prefills at most their prompt): in a layer's attention, K
    and V of every sequence in flight read back from the pages (full_attention.update's index_select), repeated to
    every query head under GQA (sdpa_attention: repeat_kv, masked SDPA), beside that layer's activations for the
    step's tokens (q, K, V, MLP); after the last layer, the sampler's fp32 logits, scores and probabilities
    [seqs, V]. The read-back K and V are gone before the logits exist, so the two are a max, not a sum; and between
    forwards, the page copy of a step's forks (fork_copy_bytes), alive with neither."""
    pool = paged_pool_bytes(shape, a, seqs, T, page_size)
    read = paged_num_blocks(shape, a, seqs, T, page_size) * page_size
    kinds = 2 if shape.sliding_layers else 1
    M = batch_tokens
    static = kinds * (M * (read + M) * a + (read + 2 * M) * 8) + 12 * (M + 32) * 4
    kv_dim, q_dim = shape.kv_dim, shape.heads * shape.head_dim
    read_back = min(seqs * T, read) * (2 * kv_dim + (2 * q_dim if q_dim > kv_dim else 0)) * a
    step_tokens = min(M, seqs * prompt) if prompt else M
    layer = step_tokens * (3 * shape.hidden + q_dim + 2 * kv_dim + 3 * shape.intermediate) * a
    sampler = 3 * seqs * shape.vocab * 4
    fork = fork_copy_bytes(shape, a, seqs, page_size, M, prompt, group, batch)
    return pool, static + max(read_back + layer, sampler, fork)


def generation_terms(shape: ModelShape, a: int, generation: str, generation_batch: int, vllm_kv_seqs: int,
                     prompt: int, T: int, paged_seqs: int | None = None, group: int = 1) -> dict:
    """The generation-phase device terms of a plan: a colocated engine's KV cache, which must hold `vllm_kv_seqs`
    full-length sequences (vLLM refuses to start below one), and its runtime; generate()'s cache and working set
    over the whole generation batch; continuous batching's page pool for `paged_seqs` full-length sequences at once
    (None: the whole generation batch) and its working set, `group` sequences sampled per prompt (forked from one
    prefill); a vLLM server nothing here."""
    engine = generation in COLOCATED
    kv, working = _generate_terms(shape, a, generation_batch, prompt, T) if generation == "generate" else (0, 0)
    pool, paged_working = (_paged_terms(shape, a, min(paged_seqs or generation_batch, generation_batch), T,
                                        prompt=prompt, group=group, batch=generation_batch)
                           if generation == "continuous_batching" else (0, 0))
    return {"vllm_kv_cache": vllm_kv_seqs * shape.kv_cache_bytes(T, a) if engine else 0,
            "vllm_runtime": VLLM_RUNTIME_BYTES if engine else 0, "generate_kv_cache": kv,
            "generate_working_set": working, "paged_kv_cache": pool, "paged_working_set": paged_working}


def vllm_memory_fraction(plan, gpu_bytes: int, cap: float = 0.95) -> float:
    """vLLM's gpu_memory_utilization: everything the training side leaves, rounded down to 0.001.

    The engine checks at start that this fraction of the GPU is free; its KV cache then gets what remains of the
    fraction after its weights and runtime, so giving it all the leftover maximizes concurrent generations.
    """
    training_only = plan.peak_bytes - plan.vllm_bytes
    fraction = min(cap, int((gpu_bytes - training_only) / gpu_bytes * 1000) / 1000)
    if fraction * gpu_bytes < plan.vllm_bytes:
        raise ValueError(f"vLLM needs {plan.vllm_bytes / GIB:.1f} GiB but training leaves "
                         f"{max(fraction, 0) * gpu_bytes / GIB:.1f} GiB: {plan.verdict(gpu_bytes)}")
    return fraction


def engine_kv_bytes(plan, gpu_bytes: int) -> int:
    """The KV cache a colocated engine allocates when it gets `vllm_memory_fraction` of the GPU: vLLM gives its KV
    cache all of its budget that its weights (shared ones included: it loaded them) and runtime leave, whole
    sequences or not."""
    budget = vllm_memory_fraction(plan, gpu_bytes) * gpu_bytes
    return int(budget - plan.vllm_bytes + plan.device["vllm_kv_cache"])


def kv_cache_sequences(plan, gpu_bytes: int) -> int:
    """Full-length sequences the KV cache holds when vLLM gets `vllm_memory_fraction` of the GPU."""
    inp = plan.inputs
    per_seq = plan.shape.kv_cache_bytes(inp["max_prompt_length"] + inp["max_completion_length"],
                                        dtype_bytes(inp["model_dtype"]))
    return engine_kv_bytes(plan, gpu_bytes) // per_seq


def record_bytes(prompt_tokens: int, completion_tokens: int) -> int:
    """Host bytes of a group's record, as Python objects in lists: a token id is a list slot (8 bytes) and an int
    (28), a behaviour log-prob a slot and a float (24), a version a slot (one int object per extend), plus a list's
    growth slack (at most 1/8 over). The planner counts carried rollouts with it
    (planning.memory); generation.rollouts' records use it."""
    return int((36 * prompt_tokens + (36 + 32 + 8) * completion_tokens) * 1.125)


def sampling_round_bytes(rows: int, prompt_tokens: int, completion_tokens: int, rounds: int) -> int:
    """Device bytes --dynamic_sampling holds beyond plain GRPO at the end of a generation batch: every round's TRL
    output (at most a generation batch each; trainer/dynamic_sampling.py) until the kept groups are merged into one
    more. Per row: prompt and completion ids and masks (int64: 16 bytes a token), and up to three per-token fp32
    log-prob tensors of the completion (old, reference, behaviour). Each round generates at most one generation
    batch, so generation's own terms do not grow; 0 with one round (dynamic sampling off)."""
    if rounds <= 1:
        return 0
    return rounds * rows * (16 * (prompt_tokens + completion_tokens) + 12 * completion_tokens)


def routing_record_bytes(shape, sequences: int, tokens: int) -> int:
    """Host bytes of --routing_replay's records of `sequences` sequences of `tokens` tokens: per token the experts
    of each MoE layer (moe_layers x top-k int16: Qwen3-30B-A3B 48 x 8 x 2 = 768 B) and the record's key (the
    sequence's token ids as a tuple: an 8-byte slot and a 28-byte int, as record_bytes counts a token id), and per
    sequence 128 bytes of objects (the key tuple's 40-byte header, the tensor's and the dict entry's). While
    they are captured the experts sit on the device, the same bytes, freed when the batch ends (under 1% of the KV
    cache they come beside: Qwen3-30B-A3B's is 96 KiB a token)."""
    return sequences * (tokens * (shape.moe_layers * shape.experts_per_token * 2 + 36) + 128)


__all__ = ["GENERATION_TERMS", "PAGED_BATCH_TOKENS", "PAGE_SIZE", "VLLM_RUNTIME_BYTES", "engine_kv_bytes",
           "generation_terms",
           "fork_copy_bytes", "kv_bytes_per_token", "kv_cache_sequences", "paged_num_blocks", "paged_pool_bytes",
           "pages_per_sequence", "record_bytes", "routing_record_bytes", "sampling_round_bytes", "vllm_memory_fraction"]
