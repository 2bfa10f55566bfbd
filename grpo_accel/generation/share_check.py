"""Is a shared-weight training model right, and how far may the engine's log-probs stray from the trainer's?

Sharing (vllm_colocate.SharedVLLM) can break one thing: the training model's base weights must be the engine's memory
*and* hold what the checkpoint holds. `checkpoint_mismatch` checks the second directly: every parameter of the HF model
bit-equal to the checkpoint's tensor of that name (cast to the run's dtype as both loaders cast it). A view cut from
the wrong rows (shifted), the wrong layer, transposed, or a weight the engine rewrote after loading fails it, naming
the parameter. What it costs: the checkpoint read once more, one tensor at a time (the engine has just read it, so
from the page cache: 16 GB for an 8B bf16 model), compared on the parameter's device; extra memory one tensor (the
largest, the embedding: 1 GiB on Llama-3.1-8B). The alternative, the HF model on the engine's weights against an HF
copy loaded from disk, costs the second copy sharing exists to avoid.

Whether the engine computes what the trainer computes is another question, and sharing plays no part in it: in bf16
the engine and HF differ by 0.23 nats on SmolLM2-135M whichever weights HF runs on, because bf16 rounding alone moves
those log-probs 0.17 nats. So its bound is measured, never fixed (`agreement`): the HF model's own rounding error on
the same sequence (its dtype against one wider, `WIDER`, run one module at a time) times AGREEMENT_MARGIN.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# The reference a dtype's rounding is measured against: the next wider float.
WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
# The engine may round up to 3x as far from the exact result as HF does (bound = (1 + 3) x HF's own error, by the
# triangle inequality through the wider result). The engine's kernels are not HF's, so its rounding differs, but it
# rounds in the same dtype: the bf16 SmolLM2-135M measured 1.3x (engine vs fp32 0.218 nats, HF vs fp32 0.166);
# share_check's tests measure it again on every run of the vLLM tier.
AGREEMENT_MARGIN = 4.0


def checkpoint_files(model_dir) -> list[Path]:
    """The checkpoint's weight files: safetensors (an index's shards or the single file), else PyTorch .bin."""
    d = Path(model_dir)
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        files = sorted(d.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {d}")


@contextlib.contextmanager
def _opened(path: Path):
    """{name: () -> tensor} of one weight file, each tensor read when called (safetensors memory-maps its file)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            yield {k: (lambda k=k: f.get_tensor(k)) for k in f.keys()}
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        yield {k: (lambda v=v: v) for k, v in state.items()}
        del state


def _tied_source(model) -> dict[str, str]:
    """{output embedding name: input embedding name} where the config ties them (the checkpoint holds one)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False) or model.get_output_embeddings() is None:
        return {}
    modules = {id(m): n for n, m in model.named_modules()}
    in_name, out_name = (f"{modules.get(id(m))}.weight" for m in (model.get_input_embeddings(),
                                                                  model.get_output_embeddings()))
    return {out_name: in_name} if out_name != in_name else {}


@torch.no_grad()
def checkpoint_mismatch(model, model_dir) -> str | None:
    """Why `model`'s parameters are not the checkpoint's, bit for bit, or None when every one is (module docstring).
    A parameter with no tensor of its name in the checkpoint cannot be verified: that is a reason too."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = _tied_source(model)
    unverified, verified = dict(params), {}  # id(parameter) -> the checkpoint key it equals
    files = checkpoint_files(model_dir)
    for path in files:
        with _opened(path) as tensors:
            for name, p in params.items():
                key = name if name in tensors else tied.get(name)
                if key not in tensors or name not in unverified:
                    continue
                if verified.get(id(p)) == key:  # a tied output embedding: the input embedding's tensor, compared once
                    del unverified[name]
                    continue
                want = tensors[key]()
                if tuple(want.shape) != tuple(p.shape):
                    return f"{name} has shape {tuple(p.shape)}, the checkpoint's {key} {tuple(want.shape)}"
                want = want.to(device=p.device, dtype=p.dtype)
                if not torch.equal(p, want):
                    diff = (p.double() - want.double()).abs()
                    return (f"{name} differs from the checkpoint's {key}: {int((diff != 0).sum())} of {p.numel()} "
                            f"values, max abs difference {diff.max().item():.3g} (a shared weight must be bit-equal)")
                del unverified[name]
                verified[id(p)] = key
    if unverified:
        names = sorted(unverified)
        return (f"{len(names)} parameter(s) not in the checkpoint to compare with, e.g. {names[0]} "
                f"(in {Path(model_dir).name}: {json.dumps([f.name for f in files][:3])})")
    return None


@contextlib.contextmanager
def computed_in(model, dtype: torch.dtype):
    """Run `model`'s forward in `dtype`, one module at a time: each module's own parameters are cast on entry and put
    back on exit. The model's tensors are never written (shared weights stay the engine's); extra memory: one module's
    parameters in `dtype`. Activations follow the embedding's output dtype through the layers."""
    saved: dict[torch.nn.Module, dict] = {}

    def cast(module, args):
        saved[module] = dict(module._parameters)
        for k, p in saved[module].items():
            if p is not None and p.is_floating_point():
                module._parameters[k] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)

    def restore(module, args, output):
        module._parameters.update(saved.pop(module))

    hooks = []
    for m in model.modules():
        if any(p is not None for p in m._parameters.values()):
            hooks += [m.register_forward_pre_hook(cast), m.register_forward_hook(restore)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for module, params in saved.items():  # a forward that raised left these cast
            module._parameters.update(params)


@torch.no_grad()
def token_logprobs(model, token_ids: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, float64, shape [T-1]; `dtype`: computed in it (`computed_in`)."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    with computed_in(model, dtype) if dtype is not None else contextlib.nullcontext():
        logits = model(input_ids=ids).logits[0, :-1].double()
    model.train(was_training)
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()


@dataclass(frozen=True)
class Agreement:
    """Engine vs HF log-probs on one sequence, and the bound this model and dtype earn (module docstring)."""

    difference: float      # max |engine - HF| (nats)
    hf_rounding: float     # max |HF in its dtype - HF in WIDER| (nats): the dtype's own rounding on this model
    bound: float           # AGREEMENT_MARGIN x hf_rounding

    @property
    def ok(self) -> bool:
        return self.difference <= self.bound  # NaN fails

    def __str__(self) -> str:
        return (f"engine vs HF log-probs {self.difference:.3g} nats max on a fixed sequence, bound {self.bound:.3g} "
                f"({AGREEMENT_MARGIN:g} x HF's own rounding {self.hf_rounding:.3g})")


def agreement(model, token_ids: list[int], engine_logprobs: torch.Tensor, dtype: torch.dtype) -> Agreement:
    """How far the engine's log-probs (`engine_logprobs`, for token_ids[1:]) are from the HF model's, against the
    bound the HF model's own rounding in `dtype` sets (its dtype vs WIDER[dtype] on the same tokens)."""
    own = token_logprobs(model, token_ids)
    wide = token_logprobs(model, token_ids, WIDER.get(dtype, torch.float64))
    rounding = (own - wide).abs().max().item()
    difference = (engine_logprobs.double() - own).abs().max().item()
    return Agreement(difference, rounding, AGREEMENT_MARGIN * rounding)


__all__ = ["AGREEMENT_MARGIN", "Agreement", "WIDER", "agreement", "checkpoint_files", "checkpoint_mismatch",
           "computed_in", "token_logprobs"]
