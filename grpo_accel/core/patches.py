"""Patches a trainer installs and undoes: every install returns its undo, `Patches` runs them newest first.

Two kinds. Per instance (a model's `forward`, a config's `_attn_implementation`): the attribute the instance held
before (or its absence) is put back. Process-wide (transformers' attention and mask registries, whose one global
mapping every model reads): reference-counted per key, so two live trainers that register the same function share
it, and the last one done puts back what was there before the first (or removes the key). A second model in the
same process then runs stock code, as after TRL's own `add_fused_lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable

_MISSING = object()
_HELD: dict[tuple[int, str], list] = {}  # (id(mapping), key) -> [count, value before the first registration]


def set_attr(obj, name: str, value) -> Callable[[], None]:
    """`obj.name = value` on this instance; the undo puts back what the instance itself held (or drops the attribute,
    so the class's shows again). A property (a config's `_attn_implementation`) gets its value before put back."""
    if isinstance(getattr(type(obj), name, None), property):
        before = getattr(obj, name)
        setattr(obj, name, value)
        return lambda: setattr(obj, name, before)
    before = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)

    def undo():
        if before is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, before)

    return undo


def register(mapping: dict, key: str, value) -> Callable[[], None]:
    """`mapping[key] = value` in a process-wide registry dict (e.g. `AttentionInterface._global_mapping`); undone
    when every registration of `key` has been undone."""
    slot = _HELD.setdefault((id(mapping), key), [0, mapping.get(key, _MISSING)])
    slot[0] += 1
    mapping[key] = value

    def undo():
        slot[0] -= 1
        if slot[0] == 0:
            del _HELD[(id(mapping), key)]
            if slot[1] is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = slot[1]

    return undo


class Patches:
    """The undos of one owner (a trainer, a SequenceParallel), run newest first by `undo()`; idempotent."""

    def __init__(self):
        self._undos: list[Callable[[], None]] = []

    def add(self, undo: Callable[[], None] | None) -> None:
        if undo is not None:
            self._undos.append(undo)

    def undo(self) -> None:
        while self._undos:
            self._undos.pop()()

    def __bool__(self) -> bool:
        return bool(self._undos)
