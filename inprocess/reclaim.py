"""What a failed iteration leaves behind is freed at its restart, not whenever the
garbage collector gets round to it.

A failed iteration's objects (its model, optimizer, process group, buffers:
on a GPU, device memory) are held by its exception: the traceback reaches
every frame the exception passed through, and each frame keeps its locals.
The exception is kept (``State.fn_exception``, the callbacks' argument), and
it sits in reference cycles (exception -> traceback -> frame -> a local that
holds the exception) that reference counting never frees. Python's collector
runs by allocation counts, and a few huge tensors are a handful of objects:
left to it, every failed iteration's memory stays alive, restart after
restart, until the process runs out.

So a restart:

* clears the locals of every finished frame of the exception's tracebacks
  (chained exceptions too). The exception and its traceback stay as they are
  to print and log: file, line and function of every frame; only what the
  frames held is let go.
* then collects the garbage of the call (:class:`CallHeap`), for what
  the iteration's own objects keep in cycles among themselves. A full
  collection of a process that has imported torch walks a few hundred
  thousand objects (about 0.15 s on a slow core), several times what a
  restart takes. The objects that exist when the call starts are frozen
  (``gc.freeze``) for the call, so a collection walks only what the call
  created since (a few milliseconds); they go back to the collector when
  the call ends. What a training step imports lazily (``torch._dynamo``,
  imported by the first optimizer step, some 200,000 objects) is imported
  before the freeze, so that it is not walked at every restart.

The cost: cyclic garbage among objects that existed before the call is
collected after the call, not during it (objects freed by reference counting,
the usual case, are freed as always).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from types import FrameType

log = logging.getLogger(__name__)


def lazy_imports() -> None:
    """What a training step imports lazily, imported now: ``torch._dynamo``, which
    the first optimizer a script builds imports (its steps are wrapped to disable
    dynamo), about as long as ``import torch`` itself; it starts no thread. A
    preloaded process (a standby, the zygote) does it ahead of the job's time,
    and a call before it freezes the heap (:class:`CallHeap`)."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as ex:  # a build without it: the first optimizer pays, as without us
        log.warning("torch._dynamo not imported ahead: %r", ex)


def stores_in_frames(ex: BaseException | None) -> list[object]:
    """The ``torch.distributed.Store`` objects that frames of ``ex``'s
    tracebacks hold in a local (the wrapped function's own store, say)."""
    import torch.distributed as dist

    found: list[object] = []
    for frame in _traceback_frames(ex):
        found += [v for v in frame.f_locals.values() if isinstance(v, dist.Store)]
    return found


def _traceback_frames(ex: BaseException | None) -> list[FrameType]:
    """Every frame of ``ex``'s tracebacks, chained exceptions' too (each exception once)."""
    frames: list[FrameType] = []
    seen: set[int] = set()
    pending: list[BaseException | None] = [ex]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]
    return frames


def clear_frames(ex: BaseException | None, prefixes: tuple[str, ...] | None = None) -> None:
    """Clears the locals of the finished frames of ``ex``'s tracebacks (chained
    exceptions too); ``prefixes``: only frames whose code file starts with one.

    A frame still executing (the caller's own, as it handles ``ex``) is left
    as it is.
    """
    for frame in _traceback_frames(ex):
        if prefixes is None or frame.f_code.co_filename.startswith(prefixes):
            with contextlib.suppress(RuntimeError):  # still executing
                frame.clear()
                # a dict of its locals made before (reading f_locals) is
                # brought in line with the cleared frame, emptied with it
                frame.f_locals  # noqa: B018


class CallHeap:
    """The garbage collector's view of one call: what existed before it is frozen.

    Invariant: ``gc.unfreeze`` is called at :meth:`close` only when this call
    froze the heap from nothing (no freeze of anyone else's was in force, such
    as the fork template's before it forked this process): a freeze made by
    someone else is never undone here; the objects this call froze on top of it
    then stay frozen with theirs.
    """

    def __init__(self) -> None:
        lazy_imports()
        self._unfreeze = gc.get_freeze_count() == 0
        gc.freeze()
        self._open = True
        #: what the last restart kept alive on purpose (see :meth:`keep`)
        self._kept: list[object] = []

    def keep(self, objects: list[object]) -> None:
        """Keeps ``objects`` alive until the next :meth:`keep` or :meth:`close`: the
        stores a failed iteration's function made. A script that builds its own
        ``TCPStore`` in every call (the usage guide's pattern: ``multi_tenant``,
        rank 0 hosting it) gets the same server back in the next call while the
        last one is alive; freed at the restart, its port would be bound anew
        while the peers' clients still reach for the old one."""
        self._kept = list(objects)

    def collect(self) -> float:
        """Collects the call's garbage (a full collection of what it created);
        returns the seconds it took."""
        started = time.perf_counter()
        found = gc.collect()
        seconds = time.perf_counter() - started
        log.debug("collected %d objects of the failed iteration in %.3f s", found, seconds)
        return seconds

    def close(self) -> None:
        self._kept = []
        if self._open:
            self._open = False
            if self._unfreeze:
                gc.unfreeze()
