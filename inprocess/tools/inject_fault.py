"""Fault injection for testing fault tolerance.

Every rank calls :func:`inject_fault` with the same arguments (in particular
the same ``seed``), so all ranks agree on which ranks are hit; on those, a
background thread injects the fault after ``delay`` seconds.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..compose import _takes_arguments
from ..monitor_thread import IMPORT_WAIT_LIMIT, async_raise, frame_in_import, is_importing

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The exception raised in the main thread by ``ASYNC_EXC`` and ``SIGNAL_EXC``."""


class Fault(enum.Enum):
    """Kinds of faults."""

    #: corrupts the CUDA context (an illegal memory access); needs a GPU
    GPU = enum.auto()
    #: a long GPU kernel: the main thread hangs in a CUDA synchronization; needs a GPU
    GPU_SLEEP = enum.auto()
    #: an exception raised asynchronously in the main thread
    ASYNC_EXC = enum.auto()
    #: a signal whose handler raises an exception in the main thread
    SIGNAL_EXC = enum.auto()
    #: ``os.abort()``: the process dies of SIGABRT
    ABORT = enum.auto()
    #: a thread that holds the GIL forever: the whole interpreter hangs
    GIL = enum.auto()
    #: a segmentation fault
    SEGFAULT = enum.auto()
    #: SIGINT: ``KeyboardInterrupt`` in the main thread
    INT = enum.auto()
    #: SIGKILL
    KILL = enum.auto()
    #: SIGTERM
    TERM = enum.auto()
    #: SIGSTOP: the process is frozen
    STOP = enum.auto()
    #: sets a flag that the workload raises on, at its next
    #: :func:`maybe_raise_workload_exception` (a "gentle" fault, at a point the
    #: workload chooses)
    WORKLOAD_EXC = enum.auto()

    # The names the newest generation's fault injector uses for the same faults
    # (aliases: ``Fault.SIGKILL is Fault.KILL``), so that its scripts run unchanged.
    GPU_ERROR = GPU
    OS_ABORT = ABORT
    LOCK_GIL = GIL
    SIGINT = INT
    SIGKILL = KILL
    SIGTERM = TERM
    SIGSTOP = STOP


GPU_FAULTS = frozenset({Fault.GPU, Fault.GPU_SLEEP})

_SIGNAL_EXC_SIGNAL = signal.SIGUSR1


class FaultInjector(threading.Timer):
    """The background thread of one injected fault; ``cancel()`` before it fires."""

    def __init__(self, fault: Fault, delay: float, callback: Callable[..., Any] | None) -> None:
        super().__init__(delay, self._fire)
        self.name = f"inprocess-inject-{fault.name}"
        self.daemon = True
        self.fault = fault
        self.callback = callback
        self.main_thread_id = threading.main_thread().ident

    def _fire(self) -> None:
        log.warning("injecting %s into rank %s", self.fault.name, os.environ.get("RANK"))
        if self.callback is not None:
            if _takes_arguments(self.callback):
                self.callback(self.fault)
            else:
                self.callback()
        _inject(self.fault, self.main_thread_id)


# Set by a WORKLOAD_EXC fault, cleared by the workload when it raises.
_workload_raise = threading.Event()


def maybe_raise_workload_exception() -> None:
    """Raises :class:`InjectedFault` once if a ``WORKLOAD_EXC`` fault fired since the last call."""
    if _workload_raise.is_set():
        _workload_raise.clear()
        raise InjectedFault("injected workload exception")


def clear_workload_exception() -> None:
    """Calls off a ``WORKLOAD_EXC`` fault that fired and was not raised yet."""
    _workload_raise.clear()


def _raise_injected(signum: int, frame: Any) -> None:
    if frame_in_import(frame):
        # not inside an import (see _inject): the signal comes again once it is done
        threading.Thread(
            target=_signal_after_import,
            args=(threading.main_thread().ident, signum),
            name="inprocess-inject-fault",
            daemon=True,
        ).start()
        return
    raise InjectedFault(f"injected by signal {signum}")


def _signal_after_import(thread_id: int, signum: int) -> None:
    deadline = time.monotonic() + IMPORT_WAIT_LIMIT
    while is_importing(thread_id) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(os.getpid(), signum)


def _inject(fault: Fault, main_thread_id: int | None) -> None:
    pid = os.getpid()
    if fault == Fault.ASYNC_EXC:
        assert main_thread_id is not None
        # Not inside an import: that would break the module for the rest of the
        # process (see inprocess.monitor_thread), a different fault than the
        # recoverable exception this one stands for.
        deadline = time.monotonic() + IMPORT_WAIT_LIMIT
        while is_importing(main_thread_id) and time.monotonic() < deadline:
            time.sleep(0.005)
        async_raise(main_thread_id, InjectedFault)
    elif fault == Fault.SIGNAL_EXC:
        os.kill(pid, _SIGNAL_EXC_SIGNAL)
    elif fault == Fault.ABORT:
        os.abort()
    elif fault == Fault.GIL:
        # PyDLL keeps the GIL during the call: nothing else in Python runs.
        ctypes.PyDLL(None).sleep(1 << 30)
    elif fault == Fault.SEGFAULT:
        ctypes.string_at(0)
    elif fault == Fault.INT:
        os.kill(pid, signal.SIGINT)
    elif fault == Fault.KILL:
        os.kill(pid, signal.SIGKILL)
    elif fault == Fault.TERM:
        os.kill(pid, signal.SIGTERM)
    elif fault == Fault.STOP:
        os.kill(pid, signal.SIGSTOP)
    elif fault == Fault.WORKLOAD_EXC:
        _workload_raise.set()
    elif fault == Fault.GPU:
        import torch

        # An out-of-bounds index on the device: the kernel faults and the
        # CUDA context is corrupted.
        x = torch.zeros(1, device="cuda")
        x[torch.tensor([1 << 40], device="cuda")] = 1
        torch.cuda.synchronize()
    elif fault == Fault.GPU_SLEEP:
        import torch

        torch.cuda._sleep(1 << 62)
        torch.cuda.synchronize()
    else:  # pragma: no cover - enum is exhaustive
        raise ValueError(f"unknown fault {fault!r}")


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"inject_fault needs the {name} environment variable")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds(
    name: str, value: object, is_kind: Callable[[object], bool], kind: str
) -> tuple[Any, Any]:
    """``(min, max)`` of a value given as one number or as a ``(min, max)`` pair, both >= 0."""
    allowed = f"a {kind} >= 0 or a (min, max) tuple of {kind}s with 0 <= min <= max"
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(is_kind(v) for v in value):
            raise TypeError(f"inject_fault({name}=...) must be {allowed}, got {value!r}")
        low, high = value
    elif is_kind(value):
        low = high = value
    else:
        raise TypeError(f"inject_fault({name}=...) must be {allowed}, got {value!r}")
    if not 0 <= low <= high:
        raise ValueError(f"inject_fault({name}=...) must be {allowed}, got {value!r}")
    return low, high


def inject_fault(
    faults: Iterable[Fault],
    num_faults: int | tuple[int, int],
    keep_alive: int,
    delay: float | tuple[float, float],
    seed: int,
    callback: Callable[[], Any] | Callable[[Fault], Any] | None = None,
) -> FaultInjector | None:
    """Schedules a fault on ``num_faults`` random ranks.

    Args:
        faults: the kinds to choose from (one is drawn per hit rank).
        num_faults: how many ranks are hit; a ``(min, max)`` tuple draws the
            number from ``min..max`` (both included).
        keep_alive: the ``keep_alive`` lowest ranks are never hit.
        delay: seconds before the fault is injected; a ``(min, max)`` tuple draws
            it uniformly from that interval.
        seed: seed of every draw (number, delay, ranks, kinds); the same on every
            rank, so that all ranks agree on the outcome.
        callback: called just before the fault, in the injecting thread; with no
            arguments, or with the fault if it takes one.

    Returns:
        On a hit rank, the started :class:`FaultInjector` (cancel it to call the
        fault off); elsewhere ``None``. Ranks come from ``RANK``/``WORLD_SIZE``.
    """
    if isinstance(faults, Fault):
        faults = [faults]
    faults = list(faults)
    if not faults:
        raise ValueError("inject_fault(faults=...) must name at least one Fault")
    for fault in faults:
        if not isinstance(fault, Fault):
            raise TypeError(f"inject_fault(faults=...) must contain Fault members, got {fault!r}")
    num_bounds = _bounds("num_faults", num_faults, _is_int, "int")
    delay_bounds = _bounds("delay", delay, _is_number, "number")
    for name, value in (("keep_alive", keep_alive), ("seed", seed)):
        if not _is_int(value):
            raise TypeError(f"inject_fault({name}=...) must be an int, got {value!r}")
    if keep_alive < 0:
        raise ValueError(f"inject_fault(keep_alive=...) must be >= 0, got {keep_alive}")
    if callback is not None and not callable(callback):
        raise TypeError(f"inject_fault(callback=...) must be callable or None, got {callback!r}")
    gpu = GPU_FAULTS.intersection(faults)
    if gpu:
        import torch

        if not torch.cuda.is_available():
            names = ", ".join(sorted(f.name for f in gpu))
            raise RuntimeError(f"inject_fault: {names} need a CUDA device, and none is available")

    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    # Every draw comes from this one generator, in a fixed order: every rank
    # computes the same number, delay, victims and kinds. A plain int or float
    # draws nothing, so those forms keep the draws they always had.
    rng = random.Random(seed)
    count = num_bounds[0] if num_bounds[0] == num_bounds[1] else rng.randint(*num_bounds)
    seconds = float(delay_bounds[0])
    if delay_bounds[0] != delay_bounds[1]:
        seconds = rng.uniform(*delay_bounds)
    candidates = list(range(keep_alive, world_size))
    victims = rng.sample(candidates, min(count, len(candidates)))
    drawn = {victim: rng.choice(faults) for victim in victims}
    if rank not in drawn:
        return None
    fault = drawn[rank]
    if fault == Fault.SIGNAL_EXC:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("inject_fault: SIGNAL_EXC must be set up from the main thread")
        signal.signal(_SIGNAL_EXC_SIGNAL, _raise_injected)
    injector = FaultInjector(fault, seconds, callback)
    injector.start()
    log.info("rank %d will get %s in %.3gs", rank, fault.name, seconds)
    return injector
