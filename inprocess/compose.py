"""Composition of callbacks of one kind (initializers, rank assignments, ...)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any


def _common_base(instances: tuple[Any, ...]) -> type:
    """The most derived class that every instance is an instance of."""
    first = type(instances[0])
    for candidate in first.__mro__:
        if candidate is object:
            break
        if all(isinstance(inst, candidate) for inst in instances):
            return candidate
    return object


_classes: dict[tuple[type, type], type] = {}


class Compose:
    """Chains callables of one kind into one callable of that kind.

    ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last listed runs first, as in
    the seed's examples. A callable returning a tuple has it unpacked into the
    arguments of the next one, so ``Finalize``/``HealthCheck`` (``(state, ex)``)
    and ``RankAssignment`` (``(state, terminated_ranks)``) chain naturally.

    The result is an instance of the callables' common base class (e.g. a
    ``Compose`` of rank assignments is a ``RankAssignment``), so it is accepted
    wherever one of them would be.
    """

    _fns: tuple[Callable[..., Any], ...]

    def __new__(cls, *fns: Callable[..., Any]) -> Compose:
        if not fns:
            raise ValueError("Compose needs at least one callable")
        for i, fn in enumerate(fns):
            if not callable(fn):
                raise TypeError(f"Compose argument {i} ({fn!r}) is not callable")
        base = _common_base(fns)
        if base is object or issubclass(base, Compose):
            klass = cls
        else:
            klass = _classes.get((cls, base))
            if klass is None:
                # A class that is both a Compose and the common base; __call__
                # comes from Compose (first in the MRO), satisfying abstract bases.
                klass = type(f"Compose[{base.__name__}]", (cls, base), {})
                if isinstance(base, abc.ABCMeta):
                    klass.__abstractmethods__ = frozenset()
                _classes[(cls, base)] = klass
        self = object.__new__(klass)
        self._fns = tuple(fns)
        return self

    def __init__(self, *fns: Callable[..., Any]) -> None:
        # Everything is set in __new__; base classes' __init__ may take other
        # arguments, so it is deliberately not called.
        pass

    def __call__(self, *args: Any) -> Any:
        result: Any = args
        for fn in reversed(self._fns):
            result = fn(*result) if isinstance(result, tuple) else fn(result)
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(f) for f in self._fns)})"
