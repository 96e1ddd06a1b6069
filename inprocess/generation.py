"""The two generations of the callback API, told apart per callback.

The usage guide's generation (our contract) and the API's newer generation
differ in the shapes of the Wrapper's callbacks (guide / newer):

* ``initialize``, ``abort``: ``(state) -> state`` / ``(frozen_state) -> frozen_state``;
* ``finalize``, ``health_check``: ``(state, exception)`` / ``(frozen_state) ->
  frozen_state``, the exception in ``frozen_state.fn_exception``;
* ``rank_assignment``: ``(state, terminated_ranks) -> (state, terminated_ranks)`` /
  ``(ctx) -> ctx`` (a :class:`~inprocess.rank_assignment.RankAssignmentCtx`),
  the rank filters being steps of it;
* ``rank_filter``: ``(state) -> state`` / (none);
* ``completion``, ``terminate``: (none) / ``(frozen_state) -> frozen_state``.

Which shape a callback expects is read from the callback itself, never from a
switch: how many positional arguments its ``__call__`` takes (``finalize``,
``health_check``, ``rank_assignment``), a ``FrozenState`` annotation
(``initialize``, ``abort``), or the argument it was given (``rank_filter`` is
the guide's, ``completion`` and ``terminate`` the newer generation's). A
:class:`inprocess.Compose` has the shape of its members. Callbacks that take
either shape (the built-in ones: ``ShiftRanks``, ``CudaHealthCheck``,
``RetryController``, the nested restarter's, ...) follow the others; a Wrapper
whose callbacks are all of that kind runs the guide's generation. Callbacks of
both generations in one Wrapper are an error naming them.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .compose import Compose
from .rank_assignment import ActivateAllRanks, RankAssignmentCtx, RankDiscarded, ShiftRanks
from .state import FrozenState, Mode, State


class Generation(enum.Enum):
    """A generation of the callback API."""

    #: the usage guide's: ``(state, ex)``, ``(state, terminated_ranks)``, ``rank_filter``
    GUIDE = "the usage guide's"
    #: the newer one: ``(frozen_state)``, ``(ctx)``, ``completion``, ``terminate``
    NEWER = "the newer generation's"


#: callbacks whose generation shows in their number of positional arguments (guide, newer)
_BY_ARITY = {
    "finalize": "(state, exception)",
    "health_check": "(state, exception)",
    "rank_assignment": "(state, terminated_ranks)",
}
_NEWER_SHAPES = {
    "finalize": "(frozen_state)",
    "health_check": "(frozen_state)",
    "rank_assignment": "(ctx)",
    "initialize": "(state: FrozenState)",
    "abort": "(state: FrozenState)",
    "completion": "(frozen_state)",
    "terminate": "(frozen_state)",
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _arity(fn: Callable[..., Any]) -> tuple[int, float] | None:
    """(required, most) positional arguments of ``fn``; None when unknown."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    required = sum(1 for p in params if p.kind in _POSITIONAL and p.default is p.empty)
    most: float = sum(1 for p in params if p.kind in _POSITIONAL)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        most = float("inf")
    return required, most


def _first_annotation(fn: Callable[..., Any]) -> Any:
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind in _POSITIONAL]
    except (TypeError, ValueError):
        return None
    return params[0].annotation if params else None


def generation_of(name: str, callback: Any) -> Generation | None:
    """The generation whose shape ``callback`` (the Wrapper's argument ``name``) expects.

    None: no callback, or one that takes either shape.
    """
    if callback is None:
        return None
    if getattr(callback, "_takes_either_generation", False):
        # e.g. the nested restarter's callbacks: (state, ...) -> state, State or FrozenState
        return None
    if name in ("completion", "terminate"):
        return Generation.NEWER
    if name == "rank_filter":
        return Generation.GUIDE
    if isinstance(callback, Compose):
        found = {m: generation_of(name, m) for m in callback._fns}
        kinds = {g for g in found.values() if g is not None}
        if len(kinds) > 1:
            raise ValueError(
                f"Wrapper({name}=...): {callback!r} composes callbacks of both generations of "
                f"the API: {_describe(name, found)}; compose callbacks of one generation"
            )
        return kinds.pop() if kinds else None
    if name in _BY_ARITY:
        arity = _arity(callback)
        if arity is None:
            return None
        required, most = arity
        if required >= 2:
            return Generation.GUIDE
        if most == 1:
            return Generation.NEWER
        return None
    if name in ("initialize", "abort"):
        annotation = _first_annotation(callback)
        if annotation is FrozenState or (
            isinstance(annotation, str) and annotation.split(".")[-1] == "FrozenState"
        ):
            return Generation.NEWER
    return None


def _describe(name: str, found: Mapping[Any, Generation | None]) -> str:
    parts = []
    for who, generation in found.items():
        if generation is None:
            continue
        shape = _NEWER_SHAPES.get(name, "") if generation is Generation.NEWER else ""
        if generation is Generation.GUIDE:
            shape = _BY_ARITY.get(name, "(state)")
        parts.append(f"{who!r} takes {generation.value} shape {shape}".rstrip())
    return "; ".join(parts)


def wrapper_generation(callbacks: Mapping[str, Any]) -> Generation:
    """The generation of a Wrapper's callbacks (argument name -> callback).

    Raises ``ValueError`` naming the arguments when they mix generations.
    """
    found = {name: generation_of(name, cb) for name, cb in callbacks.items()}
    guide = [n for n, g in found.items() if g is Generation.GUIDE]
    newer = [n for n, g in found.items() if g is Generation.NEWER]
    if guide and newer:
        raise ValueError(
            "Wrapper: the callbacks mix the two generations of the API: "
            + ", ".join(f"{n}=" for n in guide)
            + f" take the usage guide's shapes ({_shapes(guide, Generation.GUIDE)}), "
            + ", ".join(f"{n}=" for n in newer)
            + f" the newer generation's ({_shapes(newer, Generation.NEWER)}); "
            "write every callback of one Wrapper for one generation"
        )
    return Generation.NEWER if newer else Generation.GUIDE


def _shapes(names: list[str], generation: Generation) -> str:
    if generation is Generation.GUIDE:
        return ", ".join(f"{n}{_BY_ARITY.get(n, '(state)')}" for n in names)
    return ", ".join(f"{n}{_NEWER_SHAPES.get(n, '(frozen_state)')}" for n in names)


# ------------------------------------------------------------------ calling them


def frozen(state: State, fn_exception: BaseException | None = None) -> FrozenState:
    """``state`` read-only, with ``fn_exception`` (the exception of this iteration, if any)."""
    return dataclasses.replace(state.freeze(), fn_exception=fn_exception)


def invoke(
    callback: Callable[..., Any], generation: Generation, state: State, *exception: Any
) -> Any:
    """Calls a state callback in its generation's shape; returns what it returned.

    ``exception`` is the guide's second argument (``finalize``, ``health_check``):
    the newer generation finds it in ``fn_exception`` instead. What a newer
    callback returns is a FrozenState: the caller keeps its own state.
    """
    if generation is Generation.NEWER:
        return callback(frozen(state, exception[0] if exception else None))
    return callback(state, *exception)


def as_state_callback(callback: Any, generation: Generation) -> Any:
    """``callback`` callable with a State, whatever its generation (the monitor thread's abort)."""
    if callback is None or generation is Generation.GUIDE:
        return callback

    def call(state: State) -> Any:
        return callback(frozen(state))

    return call


def assign(
    assignment: Callable[..., Any],
    generation: Generation,
    state: State,
    terminated_ranks: set[int],
) -> tuple[State, set[int]]:
    """Runs a rank assignment in its generation's shape: ``(state, unhandled ranks)``."""
    if generation is Generation.GUIDE:
        return assignment(state, terminated_ranks)
    result = assignment(RankAssignmentCtx(state, state.store, set(terminated_ranks)))
    if not isinstance(result, RankAssignmentCtx):
        raise TypeError(
            f"Wrapper(rank_assignment=...): {assignment!r} takes a RankAssignmentCtx and must "
            f"return one, returned {type(result).__name__}"
        )
    if result.state.mode == Mode.TERMINATED:
        raise RankDiscarded(f"rank {state.rank} was terminated by the rank assignment")
    return result.state, set(result.terminated_ranks)


#: assignments whose membership every rank can derive: the survivors in their order
#: (exactly these classes: a subclass may decide otherwise)
_ORDER_KEEPING = (ShiftRanks, ActivateAllRanks)


def derives_membership(assignment: Callable[..., Any]) -> bool:
    """Whether ``assignment`` always makes the survivors the next membership, in their
    order: every rank can then derive it from the termination barrier's decision,
    and a restart needs no iteration barrier. True of :class:`ShiftRanks` (the
    default), of :class:`ActivateAllRanks`, and of a ``Compose`` of only these;
    an assignment that may drop, reorder or exchange (filters, ``FillGaps``,
    ``Tree``, a user's own) goes through the barrier."""
    if isinstance(assignment, Compose):
        return all(derives_membership(step) for step in assignment._fns)
    return type(assignment) in _ORDER_KEEPING


def settle(state: State, assigned: State, joined: bool) -> None:
    """Sets the mode the newer generation's assignment decided, once the barrier agreed.

    ``state`` carries the agreed rank and world size; ``assigned`` is what the
    assignment returned (``joined``: this rank joined the running job and ran
    no assignment). The assignment decides the mode, ``active_rank`` and
    ``active_world_size`` (one that decides nothing activates every rank). A
    process that joined the job is a spare until the next restart runs the
    assignment over it; the others keep what their assignment decided.
    """
    if joined:
        state.mode, state.active_rank = Mode.INACTIVE, None
        return
    if assigned.mode == Mode.INITIALIZED or assigned.active_world_size is None:
        state.activate_all()
        return
    if state.rank != assigned.rank:
        # Joiners are numbered after the survivors: a survivor's rank never moves.
        raise AssertionError(f"rank {assigned.rank} became {state.rank} at the barrier")
    active = assigned.active_world_size
    if not isinstance(active, int) or not 0 <= active <= assigned.world_size:
        raise ValueError(
            f"Wrapper(rank_assignment=...): active_world_size must be in "
            f"[0, {assigned.world_size}], got {active!r}"
        )
    if assigned.mode == Mode.ACTIVE:
        rank = assigned.active_rank
        if not isinstance(rank, int) or not 0 <= rank < active:
            raise ValueError(
                f"Wrapper(rank_assignment=...): an active rank's active_rank must be in "
                f"[0, {active}), got {rank!r}"
            )
    elif assigned.mode != Mode.INACTIVE:
        raise ValueError(
            f"Wrapper(rank_assignment=...): mode must be ACTIVE or INACTIVE, got {assigned.mode}"
        )
    state.mode = assigned.mode
    state.active_world_size = active
    state.active_rank = assigned.active_rank if assigned.mode == Mode.ACTIVE else None
