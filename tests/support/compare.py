"""One helper per meaning of "the same": bit-equal, allclose, and relative norm.

- `assert_equal(ref, got)`: torch.equal per tensor (dicts of tensors or tensors), naming the first mismatch.
- `assert_allclose(got, ref, rtol, atol)`: torch.testing.assert_close, element-wise (its message names the key).
- `rel_norm(a, b)`: ||a - b|| / ||b|| in float64; `assert_rel_close(ref, got, tol)` checks it per tensor of a dict
  and names the worst one. A zero ||b|| gives nan (0/0) or inf, which fails any bound, unless `floor` is given: the
  denominator is then max(||b||, floor), so two all-zero tensors compare equal (0) and a non-zero one against zero
  fails (huge). `nonzero=True` also asserts every reference tensor is non-zero (a saver cannot hide behind a zero
  gradient). `rel_max` is the same with the max norm (max |a - b| / max |b|), the kernels' bound.
"""

import math
from collections.abc import Mapping

import torch


def _as_dict(x) -> Mapping:
    return x if isinstance(x, Mapping) else {"tensor": x}


def assert_equal(ref, got) -> None:
    """Bit-equal: the same keys (for dicts) and torch.equal for each tensor; names the first that differs."""
    ref, got = _as_dict(ref), _as_dict(got)
    assert ref.keys() == got.keys(), f"keys differ: {sorted(set(ref) ^ set(got))}"
    for name in ref:
        assert torch.equal(ref[name], got[name]), f"{name}: not bit-equal"


def assert_allclose(got, ref, *, rtol: float, atol: float, **kwargs) -> None:
    """Element-wise |got - ref| <= atol + rtol * |ref| (torch.testing.assert_close; tensors, or dicts of them)."""
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, **kwargs)


def rel_norm(a: torch.Tensor, b: torch.Tensor, *, floor: float = 0.0, ord: float = 2) -> float:
    """||a - b|| / max(||b||, floor), in float64 (`ord`: the vector norm over all elements; math.inf for max |.|)."""
    a, b = a.detach().double(), b.detach().double()
    den = torch.linalg.vector_norm(b, ord)
    if floor:
        den = den.clamp(min=floor)
    return (torch.linalg.vector_norm(a - b, ord) / den).item()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64, the denominator floored at 1e-30 (the log-prob kernels' bound)."""
    return rel_norm(a, b, floor=1e-30, ord=math.inf)


def assert_rel_close(ref, got, tol: float, *, floor: float = 0.0, nonzero: bool = False) -> None:
    """The same keys, and rel_norm(got[name], ref[name]) <= tol for every tensor (nan fails); names the worst one.
    nonzero: every ref tensor must have a non-zero norm (checked first, naming the tensor)."""
    ref, got = _as_dict(ref), _as_dict(got)
    assert ref.keys() == got.keys(), f"keys differ: {sorted(set(ref) ^ set(got))}"
    if nonzero:
        for name, r in ref.items():
            assert r.norm() > 0, f"{name}: the reference is all zero"
    errors = {name: rel_norm(got[name], r, floor=floor) for name, r in ref.items()}
    bad = {name: e for name, e in errors.items() if not e <= tol}
    if bad:
        worst = max(bad, key=lambda n: math.inf if math.isnan(bad[n]) else bad[n])
        raise AssertionError(f"{worst}: relative error {bad[worst]:.2e} > {tol:.0e} "
                             f"({len(bad)} of {len(errors)} tensors over)")
