"""Memory planner: predicts the peak footprint of one GRPO step (what a run measures: phase_memory.py).

    plan = plan_memory(model_shape("qwen3-8b"), model_dtype="bf16", quantization="4bit", lora_r=16, num_generations=8,
                       max_prompt_length=512, max_completion_length=110_000, per_device_train_batch_size=1,
                       offload_activations=True, generation="vllm_4bit", generation_batch=8)
    print(plan.format()); print(plan.verdict(80 * 2**30))
    grpo-accel plan --preset h100_110k          # the same from the command line

A prediction, not a measurement: every term is a formula over the shape (L layers, hidden H, intermediate I,
vocab V) and the batch (B sequences of T = prompt + completion tokens per forward/backward, N_c = B * completion
tokens scored by the log-prob head). tests/test_memory.py checks it against a measured CPU step.
Terms are summed as if they were alive at once (the backward of the first layer is where they are); with
`vllm_sleep` the generation-only terms (KV cache, engine runtime) are released while training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from grpo_accel.core.dtypes import dtype_bytes, short_name
from grpo_accel.core.settings import (
    LOGPROB_IMPLS,
    OFFLOAD_RECOMPUTE_TOKENS,
    SHARE_PROMPT_MIN_SAVED,
    share_prompt_blocker,
    share_prompt_pays,
    shared_group_tokens,
)
from grpo_accel.core.units import GIB
from grpo_accel.planning.activations import (
    expert_adapter_bytes,
    expert_grad_transient_bytes,
    layer_backward_transient_per_token,
    layer_saved_bytes_per_token,
)
from grpo_accel.planning.architectures import ModelShape, model_shape
from grpo_accel.planning.generation import (
    GENERATION_TERMS,
    generation_terms,
    record_bytes,
    routing_record_bytes,
    sampling_round_bytes,
    vllm_memory_fraction,
)
from grpo_accel.planning.routes import COLOCATED, PINNED_STACK, ROUTES, choose_route

# bitsandbytes NF4 with double quantization: 4 bits per weight, an 8-bit absmax per 64-weight block, and an fp32
# scale per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# Assumptions (not measured here): what the CUDA context, cuBLAS workspaces and NCCL take outside
# torch.cuda.max_memory_allocated, and the caching allocator's fragmentation on top of the live bytes.
CUDA_CONTEXT_BYTES = 1 * GIB
FRAGMENTATION = 0.05
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768  # trl/kernels/chunked_logprob.py, trl/trainer/utils.py (TRL 1.16)
PLANNED_LOGPROB_IMPLS = ("naive", *LOGPROB_IMPLS)  # the planner also prices the naive baseline (benchmarks)

# Device-side terms; "peak" is their sum. Generation-only terms are released during training with vllm_sleep.
DEVICE_TERMS = ("weights", "lora_weights", "gradients", "optimizer_states", "activations_checkpointed",
                "recompute_working_set", "sp_all_to_all", "logprob_workspace", "vllm_weights", "vllm_kv_cache",
                "vllm_runtime", "generate_kv_cache", "generate_working_set", "paged_kv_cache", "paged_working_set",
                "sampling_rounds", "reward_models",
                "allocator_margin")
TRAINING_TRANSIENT_TERMS = ("gradients", "activations_checkpointed", "recompute_working_set", "sp_all_to_all",
                            "logprob_workspace")


def auto_logprob_block(n_tokens: int, vocab: int, device: str, act_bytes: int, chunk: int | None = None):
    """(chunk tokens, vocab tile, bytes of the live blocks): the kernel's own block planning
    (grpo_accel.ops.block_plan.plan_blocks_for_budget) at the budget it takes with >= 16 GiB free."""
    from grpo_accel.ops.block_plan import live_blocks, plan_blocks_for_budget, planned_budget_bytes

    bpe = 4 * live_blocks(None, True) + (2 if act_bytes == 2 else 0)  # fp32 blocks (+ entropy grad) + a half copy
    chunk, tile = plan_blocks_for_budget(n_tokens, vocab, device, planned_budget_bytes(device), bpe, chunk)
    return chunk, tile, chunk * tile * bpe


def _logprob_workspace(impl, shape, n_c, a, device, chunk_tokens, head_trainable) -> int:
    """Bytes of the log-prob head beyond the hidden states it reads ([N_c, H], counted with the activations)."""
    V, H = shape.vocab, shape.hidden
    if impl == "naive":
        # logits.float().log_softmax(-1).gather(): in backward the saved log-softmax output, gather's dense
        # gradient and log_softmax's input gradient are alive at once: 3 fp32 [N_c, V] (measured 2.8 on CPU).
        return 3 * n_c * V * 4
    grad_w = V * H * 4 if head_trainable else 0  # fp32 accumulator of the lm_head gradient (full fine-tune)
    if impl == "trl":
        # TRL's ChunkedLogProbFunction: one [4096, 32768] GEMM tile in the compute dtype, fp32 d(hidden) [N_c, H],
        # 7 fp32 per-token statistics
        return min(n_c, TRL_TOKEN_CHUNK) * min(V, TRL_VOCAB_CHUNK) * a + n_c * H * 4 + 7 * n_c * 4 + grad_w
    chunk, _, blocks = auto_logprob_block(n_c, V, device, a, chunk_tokens)
    if a == 2 and device == "cuda" and chunk >= n_c:
        grad_w = 0  # one token chunk: the d(weight) GEMMs write the half-precision gradient directly
    # ours: the live blocks, d(hidden) [N_c, H] in the hidden dtype, lse / logp / entropy fp32 per token
    return blocks + n_c * H * a + 3 * n_c * 4 + grad_w


def weights_bytes(shape: ModelShape, dtype_bytes: int, quantization: str) -> float:
    if quantization == "4bit":  # QLoRA: decoder linears in NF4; embeddings, lm_head, norms in the compute dtype
        linear = shape.linear_params  # MoE experts stay in the compute dtype (ModelShape.linear_params)
        return linear * NF4_BYTES_PER_PARAM + (shape.n_params - linear) * dtype_bytes
    return shape.n_params * dtype_bytes


def reward_model_bytes(shape: ModelShape, rows: int, T: int, a: int) -> int:
    """A reward model on the device (TRL's `_calculate_rewards`): its weights in the compute dtype (a classifier:
    the decoder, embeddings and a [1, H] score head, no [V, H] lm_head) and one no-grad forward over the `rows`
    prompt + completion sequences TRL scores at once (a process's generation batch: per_device_train_batch_size x
    steps_per_generation), T tokens each, with use_cache off (data/rewards.py loads it so; TRL's own loading keeps
    every layer's k and v until the forward returns: 2 kv more per layer and token). Per token: the embeddings'
    output, held through the layers [H], and one layer's peak, its MLP [3 I + 3 H] or its attention [2 H + 3 q +
    4 kv] (k and v repeated to every head, as SDPA runs on CPU). Fitted to, and checked against, live tensor bytes
    of Llama classifiers on CPU in fp32 (SDPA, right-padded rows as TRL pads; no [T, T] mask was alive at the peak),
    within 1% at H=256 with I=1024 or 64, 2 or 4 kv heads, 2 or 4 layers, 8 rows of 1024 or 2048 tokens (by hand)
    and within 2% in tests/test_own_data.py (4 rows of 512 or 1024). Not measured on a GPU."""
    H, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    weights = (shape.n_params - (0 if shape.tied else shape.vocab * H) + H) * a
    layer_peak = max(3 * shape.intermediate + 3 * H, 2 * H + 3 * q + 4 * kv)
    return int(weights + rows * T * (H + layer_peak) * a)


def _fp8_weights_bytes(shape: ModelShape, a: int) -> float:
    """vLLM's online FP8 (quantization="fp8"): every decoder linear in 1 byte (a per-tensor scale each); embeddings,
    lm_head and norms stay in the compute dtype."""
    linear = shape.layers * shape.layer_linear_params
    return linear + (shape.n_params - linear) * a


def _rerun_bytes(shape: ModelShape, a: int, B: int, T: int, per_token: float, pieces: bool, tokens) -> float:
    """One layer's backward re-run (its saved tensors + backward transients, `per_token` bytes each). With offload
    and without ZeRO-3 (any number of processes: the checkpoint returns parameter grads once) it runs in pieces of
    <= `tokens` tokens (OffloadConfig.recompute_tokens): row groups while a row fits (grpo_accel.offload.rerun),
    sequence tiles past that (grpo_accel.tiling.layer), whose full-length tensors stay: d(out) and d(in) [H], K and V
    [kv_dim] in the compute dtype, dK and dV in fp32."""
    if not pieces or not tokens:
        return B * T * per_token
    if T <= tokens:
        return min(B, max(1, tokens // T)) * T * per_token
    return tokens * per_token + T * (2 * shape.hidden * a + 2 * shape.kv_dim * (a + 4))


def _sp_rerun_bytes(shape: ModelShape, a: int, B: int, T: int, sp: int, per_token: float, pieces: bool,
                    tokens) -> float:
    """Under Ulysses SP, one layer's re-run on shards of T tokens a row: as `_rerun_bytes` while a shard row fits a
    piece; past that in sequence tiles (grpo_accel.parallel.ulysses_tiles) whose full-length tensors are the shard's
    d(out), d(in) [H] and dq [q_dim] in the compute dtype, and the whole sequence's (sp·T) K, V, one tile's full-length
    d(K), d(V) and the fp32 dK, dV sums for this rank's heads/sp of the kv heads (repeated up to sp when fewer)."""
    if not pieces or not tokens or T <= tokens:
        return _rerun_bytes(shape, a, B, T, per_token, pieces, tokens)
    kv = max(shape.kv_heads, sp) * shape.head_dim // sp
    return tokens * per_token + T * (2 * shape.hidden + shape.q_dim) * a + sp * T * 2 * kv * (2 * a + 4)


def shortest_shared_prompt(completion_len: int, num_generations: int) -> int | None:
    """The shortest prompt "auto" shares for a group of `num_generations` completions of `completion_len` tokens:
    sharing removes (G - 1)(P - 1) of G (P + C) tokens, so P >= (f G C + G - 1) / (G - 1 - f G); None below G = 2."""
    G, C, f = num_generations, completion_len, SHARE_PROMPT_MIN_SAVED
    if G - 1 - f * G <= 0:
        return None
    P = max(2, math.floor((f * G * C + G - 1) / (G - 1 - f * G)) - 1)
    while not share_prompt_pays(P, [C] * G, "auto"):  # one or two steps past the float estimate
        P += 1
    return P


def plan_memory(shape, *, model_dtype="bf16", quantization="none", lora_r=16, num_generations=8, max_prompt_length=512,
                max_completion_length=1024, per_device_train_batch_size=8, gradient_checkpointing=True,
                offload_activations=False, logprob_impl="auto", logprob_chunk_size=None, use_vllm=None,
                vllm_share_weights=None, vllm_kv_seqs=1, vllm_sleep=False, deepspeed_stage=0, num_processes=1,
                offload_optimizer=False, offload_params=False, optimizer="adamw", device="cuda",
                offload_recompute_tokens=OFFLOAD_RECOMPUTE_TOKENS, offload_device_budget_bytes=0,
                sequence_parallel_size=1, share_prompt="false", generation=None,
                generation_batch=None, reward_models=(), paged_seqs=None, rollout_budget=0,
                routing_replay="auto", sampling_rounds=1) -> MemoryPlan:
    """Predicted per-device bytes of one GRPO training step (see the module docstring).

    generation: the route that generates (planning.routes.ROUTES; None: the one use_vllm / vllm_share_weights /
    quantization imply with vLLM installed, routes.choose_route; use_vllm off is TRL's generate()); it decides
    use_vllm and vllm_share_weights (given beside it, they must agree). generation_batch: sequences
    one process generates at once (TRL: per_device_train_batch_size x steps_per_generation; None: the former).
    paged_seqs: full-length sequences continuous batching's page pool holds at once (None: the generation batch;
    `planning.fitting.paged_sequences` finds the most that fit a GPU). reward_models: (shape, rows) of each reward
    model (`reward_model_bytes`). rollout_budget: the next generation batch decodes beside this one
    (trainer/carried_rollouts.py), so continuous batching's pool holds twice the sequences (a colocated engine's KV
    cache is its fixed size, vllm_kv_seqs, with the rest queued), and the two batches' records (token ids, behaviour
    log-probs, versions) are host memory. routing_replay (not "false", a MoE on the route that records its routing,
    continuous_batching): the sequences in flight keep each token's experts on the host (`routing_record_bytes`).
    sampling_rounds: --dynamic_sampling's bound on generation rounds per generation batch (1: off), whose outputs
    are held until merged (`sampling_round_bytes`)."""
    if generation is None:
        generation = choose_route(use_vllm=bool(use_vllm), quantization=quantization, lora_r=lora_r,
                                  vllm_share_weights=vllm_share_weights is not False, stack=PINNED_STACK)[0]
    if generation not in ROUTES:
        raise ValueError(f"generation={generation!r}: use one of {tuple(ROUTES)}")
    if use_vllm is not None and bool(use_vllm) != (generation in COLOCATED) or \
            vllm_share_weights is not None and generation in COLOCATED and vllm_share_weights != (
                generation == "vllm_shared"):  # a replan must not silently keep the other route
        raise ValueError(f"use_vllm={use_vllm}, vllm_share_weights={vllm_share_weights} contradict "
                         f"generation={generation!r}: pass generation= alone")
    use_vllm, vllm_share_weights = generation in COLOCATED, generation == "vllm_shared"
    vllm_sleep = vllm_sleep and generation == "vllm_copy"
    generation_batch = generation_batch or per_device_train_batch_size
    model_dtype = short_name(model_dtype) or model_dtype  # any spelling (bf16, bfloat16); kept short
    inputs = {k: v for k, v in locals().items() if k != "shape"}
    shape = model_shape(shape)
    if logprob_impl not in PLANNED_LOGPROB_IMPLS:
        raise ValueError(f"logprob_impl={logprob_impl!r}: use one of {PLANNED_LOGPROB_IMPLS}")
    if quantization not in ("none", "4bit"):
        raise ValueError(f"quantization={quantization!r}: use 'none' or '4bit'")
    if quantization == "4bit" and lora_r <= 0:
        raise ValueError("quantization='4bit' trains adapters only: set lora_r > 0 (QLoRA)")
    step = _Step.of(shape, inputs)
    dev, host = {}, {}
    _training_state_terms(shape, step, inputs, dev, host)
    _activation_terms(shape, step, inputs, dev, host)
    _generation_side_terms(shape, step, inputs, dev, host)
    live = sum(dev.values()) - _released(dev, generation, vllm_sleep)
    dev["allocator_margin"] = CUDA_CONTEXT_BYTES + FRAGMENTATION * live if device == "cuda" else 0
    return MemoryPlan(shape, inputs, {k: int(dev[k]) for k in DEVICE_TERMS}, {k: int(v) for k, v in host.items()})


@dataclass(frozen=True)
class _Step:
    """The sizes every term reads, derived once from plan_memory's inputs."""

    a: int            # bytes per element of the compute dtype (weights outside NF4, activations)
    T: int            # tokens per sequence in the training forward
    sp: int           # Ulysses SP group size
    rows: int         # rows through the layers per micro-batch (a shared prompt's group is one row)
    T_gpu: int        # tokens of each row on one GPU
    n_tok: int        # tokens through the layers (rows x T_gpu)
    n_c: int          # completion tokens scored by the head on one GPU
    world: int        # processes ZeRO shards over (1 without DeepSpeed)
    in_flight: int    # sequences in flight (two generation batches when a budget starts the next early)
    carrying: bool    # a rollout budget carries completions across steps on this route

    @classmethod
    def of(cls, shape, i: dict) -> _Step:
        B, G, P, C = i["per_device_train_batch_size"], i["num_generations"], i["max_prompt_length"], \
            i["max_completion_length"]
        T = P + C
        # Ulysses SP (grpo_accel.parallel.sequence_parallel): an SP group of sp GPUs shares its B rows
        # (per_device_train_batch_size counts rows per group), each GPU runs T/sp tokens of each row (row groups or
        # sequence tiles in the re-run) and scores its shard; generation's KV cache (a colocated engine generates
        # whole sequences) does not shrink
        sp = max(int(i["sequence_parallel_size"] or 1), 1)
        T_gpu, rows = -(-T // sp), B
        # share_prompt: a micro-batch's rows of one prompt (min(B, G) of them) are one packed row, the prompt in it once
        group = min(B, G)
        if not share_prompt_blocker(True, sp) and share_prompt_pays(P, [C] * group, i["share_prompt"]):
            rows, T_gpu = -(-B // group), shared_group_tokens(P, [C] * group)
        carrying = i["generation"] in ("continuous_batching", *COLOCATED) and i["rollout_budget"] > 0
        return cls(a=dtype_bytes(i["model_dtype"]), T=T, sp=sp, rows=rows, T_gpu=T_gpu, n_tok=rows * T_gpu,
                   n_c=-(-B * C // sp), world=max(i["num_processes"], 1) if i["deepspeed_stage"] else 1,
                   in_flight=2 * i["generation_batch"] if carrying else i["generation_batch"], carrying=carrying)


def _training_state_terms(shape, s: _Step, i: dict, dev: dict, host: dict) -> None:
    """Weights, trainable parameters, gradients, optimizer states."""
    a, world, lora_r = s.a, s.world, i["lora_r"]
    # weights: base model; ZeRO-3 shards them and gathers ~2 layers plus the embedding at a time
    weights = weights_bytes(shape, a, i["quantization"])
    if i["deepspeed_stage"] >= 3:
        gathered = (2 * shape.layer_linear_params + shape.vocab * shape.hidden) * a
        host["weights"] = weights / world if i["offload_params"] else 0
        weights = gathered + (0 if i["offload_params"] else weights / world)
    dev["weights"] = weights
    # trainable params: LoRA adapters live in fp32 (PEFT upcasts them); full fine-tune trains the weights above
    trainable = shape.lora_params(lora_r) if lora_r > 0 else shape.n_params
    dev["lora_weights"] = trainable * 4 if lora_r > 0 else 0
    grad_bytes = 4 if lora_r > 0 else a
    dev["gradients"] = (trainable * grad_bytes / (world if i["deepspeed_stage"] >= 2 else 1)
                        + expert_grad_transient_bytes(shape, grad_bytes, lora_r))
    # optimizer: fp32 master copy when the trained weights are not fp32, then Adam m and v (fp32, or 1 byte each
    # for 8-bit Adam); ZeRO-1+ shards them, offload_optimizer moves them to host
    master = 4 if (lora_r <= 0 and a != 4) else 0
    moments = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}[i["optimizer"]]
    opt = trainable * (master + moments) / (world if i["deepspeed_stage"] >= 1 else 1)
    dev["optimizer_states"], host["optimizer_states"] = (0, opt) if i["offload_optimizer"] else (opt, 0)


def _activation_terms(shape, s: _Step, i: dict, dev: dict, host: dict) -> None:
    """Checkpointed layer inputs (on the device or offloaded), the recompute's working set, Ulysses' all-to-all,
    the log-prob head's workspace."""
    a, L, H, rows, T_gpu, n_tok, sp = s.a, shape.layers, shape.hidden, s.rows, s.T_gpu, s.n_tok, s.sp
    offload, tokens = i["offload_activations"], i["offload_recompute_tokens"]
    saved = layer_saved_bytes_per_token(shape, a, i["lora_r"])
    transient = layer_backward_transient_per_token(shape, a)
    # PEFT's adapted experts (Qwen3-MoE LoRA): per MoE layer, whatever the tokens; one layer's peak at a time
    adapter_saved, adapter_peak = expert_adapter_bytes(shape, a, i["lora_r"])
    if i["gradient_checkpointing"]:
        # each layer's input [B, T, H] plus the final hidden states fed to the head: (L + 1) tensors;
        # offload keeps <= 2 of them on the device (the one in use and the one being prefetched), plus the first
        # ones up to offload_device_budget_bytes (OffloadConfig.device_budget_bytes, grpo_accel.offload.residency)
        ckpt, layer_input = (L + 1) * n_tok * H * a, n_tok * H * a
        kept = min(L - 1, int(i["offload_device_budget_bytes"] // layer_input)) if offload else 0
        on_device = min(2 + max(kept, 0), L + 1) * layer_input if offload else ckpt
        dev["activations_checkpointed"], host["activations_offloaded"] = on_device, ckpt - on_device
        pieces = offload and i["deepspeed_stage"] < 3
        dev["recompute_working_set"] = (
            _rerun_bytes(shape, a, rows, T_gpu, saved + transient, pieces, tokens) if sp == 1 else
            _sp_rerun_bytes(shape, a, rows, T_gpu, sp, saved + transient, pieces, tokens)
        ) + adapter_peak
    else:  # every layer keeps everything
        dev["activations_checkpointed"] = L * n_tok * saved + n_tok * H * a + shape.moe_layers * adapter_saved
        dev["recompute_working_set"] = n_tok * transient + adapter_peak - adapter_saved
    # Ulysses all-to-all: q, k, v and the attention output of one layer call, each once as sent and once as received
    # ([T/sp, all heads] <-> [T, heads/sp]: the same bytes), for the rows of one re-run piece, or one sequence tile
    # of a longer shard (all rows without offload); kv heads repeated up to sp when fewer (DeepSpeed)
    kv_dim = max(shape.kv_heads, sp) * shape.head_dim
    pieces = i["gradient_checkpointing"] and offload and i["deepspeed_stage"] < 3 and tokens
    a2a_tokens = (min(rows, max(1, tokens // T_gpu)) * T_gpu if T_gpu <= tokens else tokens) if pieces else n_tok
    dev["sp_all_to_all"] = 2 * a2a_tokens * (2 * shape.heads * shape.head_dim + 2 * kv_dim) * a if sp > 1 else 0
    dev["logprob_workspace"] = _logprob_workspace(i["logprob_impl"], shape, s.n_c, a, i["device"],
                                                  i["logprob_chunk_size"], i["lora_r"] <= 0)


def _generation_side_terms(shape, s: _Step, i: dict, dev: dict, host: dict) -> None:
    """Generation, by route: a colocated engine's own weights (none when it shares the trainer's) and a KV cache that
    must hold vllm_kv_seqs full-length sequences (vLLM refuses to start below one); generate() holds the whole
    generation batch's cache; a vLLM server nothing here. Then the carried rollouts' records and reward models."""
    a, generation = s.a, i["generation"]
    dev["vllm_weights"] = {"vllm_4bit": weights_bytes(shape, a, "4bit"), "vllm_fp8": _fp8_weights_bytes(shape, a),
                           "vllm_copy": weights_bytes(shape, a, "none")}.get(generation, 0)
    dev.update(generation_terms(shape, a, generation, s.in_flight, i["vllm_kv_seqs"], i["max_prompt_length"], s.T,
                                i["paged_seqs"], group=i["num_generations"]))
    if s.carrying:  # one record per group: its prompt once, its G completions' tokens
        host["carried_rollouts"] = s.in_flight // i["num_generations"] * record_bytes(
            i["max_prompt_length"], i["num_generations"] * s.T)
    if i["routing_replay"] != "false" and generation == "continuous_batching" and shape.moe_layers:
        host["routing_records"] = routing_record_bytes(shape, s.in_flight, s.T)
    dev["sampling_rounds"] = sampling_round_bytes(i["generation_batch"], i["max_prompt_length"],
                                                  i["max_completion_length"], i["sampling_rounds"])
    dev["reward_models"] = sum(reward_model_bytes(model_shape(rm), rows, s.T, a) for rm, rows in i["reward_models"])


def _released(dev: dict, generation: str, vllm_sleep: bool) -> float:
    """Bytes not alive at the training peak: generation's terms when they are freed before training (a sleeping
    engine, generate()'s cache), up to the training transients they make room for (the peak is the larger phase)."""
    if not (vllm_sleep or generation in ("generate", "continuous_batching")):
        return 0
    return min(sum(dev[k] for k in GENERATION_TERMS), sum(dev[k] for k in TRAINING_TRANSIENT_TERMS))


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_bytes: int
    gpu_bytes: int
    fixes: tuple = ()  # (description, predicted peak bytes, fits alone)
    message: str = ""

    def __str__(self):
        return self.message


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    inputs: dict
    device: dict  # term -> bytes on each device (DEVICE_TERMS)
    host: dict = field(default_factory=dict)  # term -> bytes in host memory per process

    @property
    def peak_bytes(self) -> int:
        inp = self.inputs
        return int(sum(self.device.values()) - _released(self.device, inp["generation"], inp["vllm_sleep"]))

    @property
    def reserved_bytes(self) -> int:
        """What torch.cuda.max_memory_reserved() should report: the peak without the CUDA context (not torch's)."""
        return self.peak_bytes - (CUDA_CONTEXT_BYTES if self.inputs["device"] == "cuda" else 0)

    @property
    def route(self) -> str:
        return self.inputs["generation"]

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def vllm_bytes(self) -> int:
        """What vLLM's gpu_memory_utilization budget must cover: its weights (the shared ones too), KV, runtime."""
        shared = self.device["weights"] if self.inputs["use_vllm"] and self.inputs["vllm_share_weights"] else 0
        return int(shared + sum(self.device[k] for k in ("vllm_weights", "vllm_kv_cache", "vllm_runtime")))

    def generation_bytes(self, gpu_bytes: int | None = None, optimizer_states: bool = True) -> int:
        """The device bytes alive while this run generates: every term but the training transients, with the margin
        the peak gets (CUDA context, fragmentation). `gpu_bytes`: a colocated engine on that GPU, as the run sizes
        it (vllm_memory_fraction), whose KV cache takes the engine's whole budget (generation.engine_kv_bytes), not
        the plan's whole sequences; vLLM measures its own use against that budget, so no fragmentation is added to
        it. `optimizer_states=False`: before the first step, when none exist yet."""
        terms = {k: v for k, v in self.device.items() if k not in TRAINING_TRANSIENT_TERMS + ("allocator_margin",)}
        if not optimizer_states:
            terms["optimizer_states"] = 0
        engine = 0
        if gpu_bytes is not None and self.route in COLOCATED:
            # the engine's budget holds its weights (the shared ones too: it loaded them), runtime and KV cache
            engine = vllm_memory_fraction(self, gpu_bytes) * gpu_bytes
            own = ("vllm_weights", "vllm_kv_cache", "vllm_runtime")
            terms["weights"] -= self.vllm_bytes - sum(terms.pop(k) for k in own)  # the shared weights: the engine's
        live = sum(terms.values())
        margin = CUDA_CONTEXT_BYTES + FRAGMENTATION * live if self.inputs["device"] == "cuda" else 0
        return int(live + engine + margin)

    def replan(self, **changes) -> MemoryPlan:
        inputs = {**self.inputs, **changes}
        if "generation" in changes:  # the flags this plan derived from its route follow the new one
            inputs.update(use_vllm=changes.get("use_vllm"), vllm_share_weights=changes.get("vllm_share_weights"))
        return plan_memory(self.shape, **inputs)

    def format(self) -> str:
        lines = [f"{'term':<26}{'GiB':>10}"]
        lines += [f"{k:<26}{v / GIB:>10.2f}" for k, v in self.device.items() if v]
        lines.append(f"{'peak (device)':<26}{self.peak_gib:>10.2f}")
        lines += [f"{'host: ' + k:<26}{v / GIB:>10.2f}" for k, v in self.host.items() if v]
        return "\n".join(lines)

    def verdict(self, gpu_mem_bytes: int) -> Verdict:
        return _verdict(self, int(gpu_mem_bytes))


def _largest_fitting(plan: MemoryPlan, key: str, hi: int, gpu: int, step: int = 1):
    """Largest value of integer input `key` in [1, hi) that fits, by bisection (the peak grows with it)."""
    lo = 1
    if plan.replan(**{key: lo}).peak_bytes > gpu:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan.replan(**{key: mid}).peak_bytes <= gpu else (lo, mid)
    return lo // step * step if lo >= step else lo


def _verdict(plan: MemoryPlan, gpu: int) -> Verdict:
    p, inp = plan.peak_bytes, plan.inputs
    head = f"predicted peak {p / GIB:.1f} GiB of {gpu / GIB:.1f} GiB"
    if p <= gpu:
        return Verdict(True, p, gpu, (), f"fits: {head} ({(gpu - p) / GIB:.1f} GiB headroom)")
    toggles = []
    if inp["gradient_checkpointing"] and not inp["offload_activations"]:
        toggles.append(("--offload_activations true", dict(offload_activations=True)))
    if not inp["gradient_checkpointing"]:
        toggles.append(("--gradient_checkpointing true", dict(gradient_checkpointing=True)))
    if inp["logprob_impl"] in ("naive", "trl"):
        toggles.append(("--logprob_impl auto (fused head)", dict(logprob_impl="auto")))
    if inp["generation"] == "vllm_copy" and inp["lora_r"] > 0 and inp["quantization"] == "none":
        toggles.append(("--vllm_share_weights true", dict(generation="vllm_shared")))
    colocated = inp["generation"] in COLOCATED
    if inp["quantization"] == "none" and inp["lora_r"] > 0:  # QLoRA's engine quantizes its own copy
        toggles.append(("--quantization 4bit (QLoRA)", dict(quantization="4bit", generation="vllm_4bit") if colocated
                        else dict(quantization="4bit")))
    if inp["lora_r"] <= 0:  # LoRA's engine shares the base
        toggles.append(("--lora_r 16 (LoRA instead of all weights)", dict(lora_r=16, generation="vllm_shared")
                        if inp["generation"] == "vllm_copy" else dict(lora_r=16)))
    fixes = [(text, plan.replan(**chg).peak_bytes) for text, chg in toggles]
    if inp["per_device_train_batch_size"] > 1:
        b = _largest_fitting(plan, "per_device_train_batch_size", inp["per_device_train_batch_size"], gpu)
        if b:
            fixes.append((f"--per_device_train_batch_size {b}", plan.replan(per_device_train_batch_size=b).peak_bytes))
    t = _largest_fitting(plan, "max_completion_length", inp["max_completion_length"], gpu, step=128)
    if t:
        fixes.append((f"--max_completion_length {t}", plan.replan(max_completion_length=t).peak_bytes))
    combined = plan.replan(**{k: v for _, chg in toggles for k, v in chg.items()}) if toggles else None
    fixes = [(text, peak, peak <= gpu) for text, peak in sorted(fixes, key=lambda f: f[1])]
    parts = [f"{text} (-> {peak / GIB:.1f} GiB{', fits' if ok else ''})" for text, peak, ok in fixes]
    # each fix is a launch/train.py flag (tests/test_cli.py holds them to the parser)
    msg = f"does not fit: {head}, short by {(p - gpu) / GIB:.1f} GiB. Fixes, each alone: " + "; ".join(parts)
    if combined is not None and not any(ok for *_, ok in fixes):
        msg += f". All switches together: {combined.peak_gib:.1f} GiB" + (
            ", fits" if combined.peak_bytes <= gpu else ": still too big, use a bigger GPU or a smaller model")
    return Verdict(False, p, gpu, tuple(fixes), msg)


__all__ = ["GIB", "MemoryPlan", "Verdict", "auto_logprob_block", "layer_saved_bytes_per_token",
           "plan_memory", "weights_bytes"]
