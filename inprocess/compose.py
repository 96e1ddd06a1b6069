"""Composition of callbacks of one kind (initializers, rank assignments, ...)."""

from __future__ import annotations

import abc
import inspect
import warnings
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
_SUBCLASSABLE = 1 << 10  # Py_TPFLAGS_BASETYPE

_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
)


def _takes_arguments(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts positional arguments (unknown signatures are assumed to)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    return any(p.kind in _POSITIONAL for p in signature.parameters.values())


class Compose:
    """Chains callables of one kind into one callable of that kind.

    ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last listed runs first, as in
    the seed's examples. How one result becomes the next callable's arguments:

    * a tuple is unpacked into its arguments, so ``Finalize``/``HealthCheck``
      (``(state, ex)``) and ``RankAssignment`` (``(state, terminated_ranks)``)
      chain naturally; any other value is its one argument;
    * a callable that takes no arguments is called with none (its result is
      passed on as usual);
    * ``None`` is no value: the next callable gets the same arguments the one
      returning ``None`` was offered. When that one was given arguments and the
      next one takes some, it most likely forgot to return them: a
      ``UserWarning`` says so.

    ``Compose(...)(...)`` returns what the first listed callable returned.

    The composition is an instance of the callables' common base class (e.g. a
    ``Compose`` of rank assignments is a ``RankAssignment``), so it is accepted
    wherever one of them would be.
    """

    _fns: tuple[Callable[..., Any], ...]
    _wants_args: tuple[bool, ...]  # per callable: whether it takes positional arguments

    def __new__(cls, *fns: Callable[..., Any]) -> Compose:
        if not fns:
            raise ValueError("Compose needs at least one callable")
        for i, fn in enumerate(fns):
            if not callable(fn):
                raise TypeError(f"Compose argument {i} ({fn!r}) is not callable")
        base = _common_base(fns)
        # Only plain Python classes are mixed in: functions, partials and other
        # built-in callables have a common type that cannot (or must not) be
        # subclassed, and their composition is a plain Compose.
        if (
            base is object
            or issubclass(base, Compose)
            or base.__new__ is not object.__new__
            or not base.__flags__ & _SUBCLASSABLE
        ):
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
        self._wants_args = tuple(_takes_arguments(fn) for fn in fns)
        return self

    def __init__(self, *fns: Callable[..., Any]) -> None:
        # Everything is set in __new__; base classes' __init__ may take other
        # arguments, so it is deliberately not called.
        pass

    def __call__(self, *args: Any) -> Any:
        offered: tuple[Any, ...] = args
        result: Any = None
        steps = list(zip(self._fns, self._wants_args, strict=True))[::-1]
        for i, (fn, takes_arguments) in enumerate(steps):
            given = offered if takes_arguments else ()
            result = fn(*given)
            if result is None:
                following = steps[i + 1] if i + 1 < len(steps) else None
                if given and following is not None and following[1]:
                    warnings.warn(
                        f"Compose: {fn!r} was given arguments but returned None, so "
                        f"{following[0]!r} gets the same arguments instead; return the "
                        "value(s) to pass on",
                        UserWarning,
                        stacklevel=2,
                    )
                continue
            offered = result if isinstance(result, tuple) else (result,)
        return result

    @property
    def instances(self) -> list[Callable[..., Any]]:
        """The composed callables, nested compositions flattened, in the order given."""
        found: list[Callable[..., Any]] = []
        for fn in self._fns:
            found += fn.instances if isinstance(fn, Compose) else [fn]
        return found

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(f) for f in self._fns)})"
