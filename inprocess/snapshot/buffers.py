"""Host buffers of snapshots: one flat byte buffer per snapshot, reused, double-buffered.

A :class:`HostSnapshot` holds one state at one step: its skeleton (pickled per
key) and every tensor's bytes in one flat ``uint8`` buffer, each tensor at an
aligned offset. The buffer is reused from commit to commit (reallocated only
when the state grows), pinned when the state has CUDA tensors so the
device-to-host copy runs asynchronously on a side stream. Host tensors are
copied by a :class:`HostCopier` thread while the next step begins (its
forward and backward pass read the state, they do not change it); the next
optimizer step waits for the copy, and a copy whose source changed meanwhile
(tensor version counters) is discarded, never restored.

A :class:`SlotPair` holds two of them: the last complete snapshot and the one
being written. Invariant: a snapshot's ``step`` is ``None`` from the moment
anything starts overwriting its buffer until every byte of the new state is
in it (for CUDA copies: until the copy's event has completed), so a commit or
transfer torn anywhere (an exception, an interruption, a crash) leaves a
snapshot that is never restored, and the other slot intact.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import pickle
import threading
import weakref
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import layout

log = logging.getLogger(__name__)

#: byte alignment of each tensor in a snapshot's buffer (any dtype can view it)
ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostSnapshot:
    """One snapshot: skeleton + flat buffer; ``step is None`` when not complete."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.shard = 0
        self.skeleton: dict[str, bytes] = {}
        self.refs: list[layout.TensorRef] = []
        self.offsets: list[int] = []
        #: bytes of each key in the buffer: key -> (start, end)
        self.ranges: dict[str, tuple[int, int]] = {}
        self.nbytes = 0
        self.data = torch.empty(0, dtype=torch.uint8)
        #: the asynchronous copy in flight: a CUDA event or a :class:`_ThreadCopy`
        self._event: Any = None
        self._pending_step: int | None = None
        self._copier: HostCopier | None = None  # set before any copy is handed to it

    # ---------------------------------------------------------------- state

    @property
    def complete(self) -> bool:
        """Whether the snapshot holds a whole state (polls an asynchronous copy)."""
        if self._event is not None and self._event.query():
            self._finish_async()
        return self.step is not None

    def wait(self) -> None:
        """Waits for an asynchronous copy in flight to land."""
        if self._event is not None:
            self._event.synchronize()
            self._finish_async()

    def _finish_async(self) -> None:
        # Invariant: the copy is forgotten before its outcome is read, so an
        # error of the copy's thread is raised once (at the next commit or
        # restore) and leaves the snapshot incomplete.
        event, self._event = self._event, None
        step, self._pending_step = self._pending_step, None
        if isinstance(event, _ThreadCopy) and not event.intact():
            return
        self.step = step

    def invalidate(self) -> None:
        """Marks the snapshot incomplete; first thing before its buffer is overwritten."""
        self.step = None
        self._pending_step = None
        if self._event is not None:
            # an in-flight copy still writes into the buffer: let it land first
            self._event.synchronize()
            self._event = None
        elif self._copier is not None:
            # a copy handed to the thread by a fill that an exception interrupted
            # before it kept the copy's handle: the thread's queue is in order
            self._copier.drain()

    def release(self) -> None:
        self.invalidate()
        self.data = torch.empty(0, dtype=torch.uint8)
        self.skeleton, self.refs, self.offsets, self.ranges, self.nbytes = {}, [], [], {}, 0

    # ---------------------------------------------------------------- layout

    def _plan(self, skeleton: Mapping[str, Any]) -> None:
        """Offsets of every tensor, key by key, and the buffer's size."""
        self.refs, self.offsets, self.ranges = [], [], {}
        offset = 0
        for key, (_kind, value) in skeleton.items():
            start = offset
            for ref in layout.refs(value):
                self.refs.append(ref)
                self.offsets.append(offset)
                offset = _aligned(offset + _numel(ref) * _itemsize(ref.dtype))
            self.ranges[key] = (start, offset)
        self.nbytes = offset

    def _reserve(self, nbytes: int, pin: bool) -> None:
        if self.data.numel() >= nbytes and (not pin or self.data.is_pinned()):
            return
        capacity = max(nbytes, 1)
        if pin:
            self.data = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        else:
            self.data = torch.empty(capacity, dtype=torch.uint8)

    def _zero_padding(self) -> None:
        """Zeroes the alignment gaps: a snapshot's bytes are all defined (checksums)."""
        end = 0
        for ref, offset in zip(self.refs, self.offsets, strict=True):
            if offset > end:
                self.data[end:offset].zero_()
            end = offset + _numel(ref) * _itemsize(ref.dtype)
        if self.nbytes > end:
            self.data[end : self.nbytes].zero_()

    def views(self) -> list[torch.Tensor]:
        """Each tensor of the snapshot as a view into the buffer."""
        out = []
        for ref, offset in zip(self.refs, self.offsets, strict=True):
            n = _numel(ref) * _itemsize(ref.dtype)
            out.append(self.data[offset : offset + n].view(ref.dtype).view(ref.shape))
        return out

    # ---------------------------------------------------------------- writing

    def fill(
        self,
        step: int,
        shard: int,
        state: Mapping[str, Any],
        copier: HostCopier | None = None,
    ) -> None:
        """Copies ``state`` in: CUDA tensors on a side stream, host tensors on
        ``copier``'s thread or, without one, here; the snapshot completes when
        the copy lands."""
        skeleton, tensors = layout.capture(state)
        self.invalidate()
        self.shard = shard
        self._plan(skeleton)
        on_cuda = any(t.is_cuda for t in tensors)
        self._reserve(self.nbytes, pin=on_cuda and torch.cuda.is_available())
        self._zero_padding()
        self.skeleton = {
            k: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for k, v in skeleton.items()
        }
        views = self.views()
        if on_cuda:
            self._copy_async(step, views, tensors)
            return
        if copier is not None and copier.can_take(tensors):
            # subclasses (a __torch_function__ may run Python, a DTensor a
            # collective) are copied here, in the training thread; plain
            # tensors on the copier's thread
            inline = [i for i, t in enumerate(tensors) if type(t) is not torch.Tensor]
            with torch.no_grad():
                for i in inline:
                    views[i].copy_(tensors[i])
            skip = set(inline)
            plain = [i for i in range(len(tensors)) if i not in skip]
            self._copier = copier  # first: see invalidate()
            self._pending_step = step
            self._event = copier.submit([views[i] for i in plain], [tensors[i] for i in plain])
            return
        with torch.no_grad():
            for dst, src in zip(views, tensors, strict=True):
                dst.copy_(src)
        self.step = step

    def _copy_async(
        self, step: int, views: list[torch.Tensor], tensors: list[torch.Tensor]
    ) -> None:
        # Invariant: the side stream starts after every kernel queued so far on
        # the current stream (the state is final), and the current stream waits
        # for the copy before anything queued later can modify the state.
        stream = _side_stream()
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in zip(views, tensors, strict=True):
                if src.is_cuda:
                    # the allocator must not hand src's memory out before the copy ran
                    src.record_stream(stream)
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        current.wait_event(event)
        self._pending_step = step
        self._event = event

    def assign(
        self, step: int, shard: int, skeleton: dict[str, bytes], refs: list[layout.TensorRef]
    ) -> torch.Tensor:
        """Prepares the buffer for bytes that arrive from elsewhere (a peer, disk);
        returns the region to fill; :meth:`seal` makes it complete."""
        self.invalidate()
        self.shard = shard
        self.skeleton = dict(skeleton)
        self.refs, self.offsets, self.ranges = [], [], {}
        offset = 0
        by_key = _refs_by_key(skeleton)
        for key in skeleton:
            start = offset
            for ref in by_key[key]:
                self.refs.append(ref)
                self.offsets.append(offset)
                offset = _aligned(offset + _numel(ref) * _itemsize(ref.dtype))
            self.ranges[key] = (start, offset)
        self.nbytes = offset
        self._reserve(self.nbytes, pin=False)
        self._zero_padding()
        self._pending_step = step
        return self.data[: self.nbytes]

    def seal(self) -> None:
        """The bytes announced by :meth:`assign` are all in: the snapshot is complete."""
        self.step, self._pending_step = self._pending_step, None

    def copy_from(self, other: HostSnapshot) -> None:
        """This snapshot becomes a copy of ``other`` (complete)."""
        assert other.step is not None
        region = self.assign(other.step, other.shard, other.skeleton, other.refs)
        region.copy_(other.data[: other.nbytes])
        self.seal()

    # ---------------------------------------------------------------- reading

    def unpickled(self) -> dict[str, Any]:
        return {k: pickle.loads(v) for k, v in self.skeleton.items()}

    def load_into(self, state: dict[str, Any]) -> None:
        """Loads the snapshot into the live ``state`` (from clones: the buffer is reused)."""
        assert self.step is not None
        tensors = []
        for view, ref in zip(self.views(), self.refs, strict=True):
            device = ref.device
            if device.startswith("cuda") and not torch.cuda.is_available():
                device = "cpu"
            tensors.append(view.to(device, copy=True))
        layout.load(state, self.unpickled(), tensors)

    def checksums(self) -> dict[str, int]:
        """A CRC-32 per key, of its skeleton and of its bytes."""
        self.wait()
        out = {}
        raw = self.data[: self.nbytes].numpy() if self.nbytes else b""
        for key, blob in self.skeleton.items():
            start, end = self.ranges[key]
            out[key] = zlib.crc32(memoryview(raw)[start:end], zlib.crc32(blob))
        return out


def _refs_by_key(skeleton: Mapping[str, bytes]) -> dict[str, list[layout.TensorRef]]:
    return {k: layout.refs(pickle.loads(v)[1]) for k, v in skeleton.items()}


def _numel(ref: layout.TensorRef) -> int:
    n = 1
    for d in ref.shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream() -> Any:
    device = torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream()
    return stream


class _ThreadCopy:
    """One snapshot's host copy on the copier's thread; event-like (``query``,
    ``synchronize``) so :class:`HostSnapshot` treats it as a CUDA copy."""

    def __init__(self, copier: HostCopier, future: concurrent.futures.Future[list[int]]) -> None:
        self._copier = copier
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        concurrent.futures.wait([self._future])

    def intact(self) -> bool:
        """Whether no source changed while it was copied (waits for the copy;
        raises the copy's own error)."""
        changed = self._future.result()
        if changed:
            self._copier._torn(len(changed))
        return not changed


class HostCopier:
    """Copies host snapshots on one thread, overlapping the start of the next step.

    The optimizer step is where a training step changes its state in place:
    a global optimizer step pre-hook waits for every copy in flight, so the
    common case never tears. Anything else that changes a source meanwhile
    is caught by its version counter; that snapshot is discarded (the slot
    pair's other snapshot stays the newest complete one) and the copier turns
    synchronous for the rest of the call, with one warning. The thread and
    the hook end at :meth:`close`, or when the copier is collected.
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        #: copies queued or running, changed under the lock, read without it (an
        #: int): an optimizer step with nothing in flight pays no round trip
        self._in_flight = 0
        self._lock = threading.Lock()
        self.synchronous = False

    def can_take(self, tensors: Sequence[torch.Tensor]) -> bool:
        # inference tensors have no version counter: nothing would catch a change
        return not self.synchronous and not any(t.is_inference() for t in tensors)

    def submit(self, views: list[torch.Tensor], tensors: list[torch.Tensor]) -> _ThreadCopy:
        if self._executor is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="inprocess-snapshot-copy"
            )
            # the hook holds the copier weakly: a copier never closed is still collected
            hook = register_optimizer_step_pre_hook(
                functools.partial(_drain_before_step, weakref.ref(self))
            )
            self._finalizer = weakref.finalize(self, _release, self._executor, hook)
        # Invariant: versions taken before the copy starts and compared on the
        # copy's thread as soon as it ends (before anyone waiting on it goes on):
        # a source modified in between (an in-place op anywhere) has a new version.
        versions = [t._version for t in tensors]
        with self._lock:
            self._in_flight += 1
        future = self._executor.submit(_copy, views, tensors, versions)
        future.add_done_callback(self._landed)
        return _ThreadCopy(self, future)

    def _landed(self, _future: concurrent.futures.Future[list[int]]) -> None:
        with self._lock:
            self._in_flight -= 1

    def drain(self) -> None:
        """Waits for every copy in flight (one thread, first in first out: for
        a no-op queued behind them)."""
        if self._executor is not None and self._in_flight:
            self._executor.submit(_nothing).result()

    def _torn(self, n: int) -> None:
        if not self.synchronous:
            self.synchronous = True
            log.warning(
                "a snapshot's source changed while it was copied (%d tensors modified in place "
                "outside the optimizer step, before the next commit): that snapshot is discarded "
                "and later commits copy synchronously",
                n,
            )

    def close(self) -> None:
        """Waits for the copies in flight and ends the thread and the hook."""
        self.drain()
        if self._finalizer is not None:
            self._finalizer()  # removes the hook, ends the thread
            assert self._executor is not None
            self._executor.shutdown(wait=True)
            self._executor = self._finalizer = None


def _drain_before_step(ref: weakref.ref[HostCopier], _optimizer: Any, _args: Any, _kw: Any) -> None:
    copier = ref()
    if copier is not None:
        copier.drain()


def _release(executor: concurrent.futures.ThreadPoolExecutor, hook: Any) -> None:
    hook.remove()
    executor.shutdown(wait=False)  # may run on any thread, the copier's own included


def _nothing() -> None:
    return None


def _copy(views: list[torch.Tensor], tensors: list[torch.Tensor], versions: list[int]) -> list[int]:
    """Copies the sources; returns the indices of those changed meanwhile."""
    with torch.no_grad():
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)
    return [i for i, (t, v) in enumerate(zip(tensors, versions, strict=True)) if t._version != v]


class SlotPair:
    """Two snapshots of one shard: the last complete one is never the one written."""

    def __init__(self) -> None:
        self.slots = (HostSnapshot(), HostSnapshot())

    def writable(self) -> HostSnapshot:
        """The slot to write next: an incomplete one, else the older complete one."""
        for s in self.slots:
            s.wait()  # a copy in flight decides whether its slot is complete
        a, b = self.slots
        if not a.complete:
            return a
        if not b.complete:
            return b
        return a if a.step <= b.step else b  # type: ignore[operator]

    def held(self) -> list[HostSnapshot]:
        """Complete snapshots, newest first."""
        done = [s for s in self.slots if s.complete]
        return sorted(done, key=lambda s: s.step, reverse=True)  # type: ignore[arg-type,return-value]

    def at(self, step: int) -> HostSnapshot | None:
        return next((s for s in self.held() if s.step == step), None)

    def drop_from(self, step: int) -> None:
        """Forgets snapshots of ``step`` and later (a restore went back before them)."""
        for s in self.slots:
            if s.complete and s.step >= step:  # type: ignore[operator]
                s.invalidate()

    def release(self) -> None:
        for s in self.slots:
            s.release()
