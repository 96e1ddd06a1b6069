"""Host buffers of snapshots: one flat byte buffer per snapshot, reused, double-buffered.

A :class:`HostSnapshot` holds one state at one step: its skeleton (pickled per
key) and every tensor's bytes in one flat ``uint8`` buffer, each tensor at an
aligned offset. The buffer is reused from commit to commit (reallocated only
when the state grows), pinned when the state has CUDA tensors. Host tensors
are copied by a :class:`HostCopier` thread while the next step begins (its
forward and backward pass read the state, they do not change it); the next
optimizer step waits for the copy, and a copy whose source changed meanwhile
(tensor version counters) is discarded, never restored. CUDA tensors are
copied by a :class:`DeviceCopier` on a side stream, beside the training
stream (its docstring says when training waits for what).

A :class:`SlotPair` holds two of them: the last complete snapshot and the one
being written. Invariant: a snapshot's ``step`` is ``None`` from the moment
anything starts overwriting its buffer until every byte of the new state is
in it (for CUDA copies: until the copy's event has completed), so a commit or
transfer torn anywhere (an exception, an interruption, a crash) leaves a
snapshot that is never restored, and the other slot intact.

A complete snapshot may be *held* by another thread that reads it (the disk
writer making its private copy, :class:`inprocess.snapshot.persist.Persister`):
everything that changes a snapshot goes through :meth:`HostSnapshot.invalidate`
first, and that waits until no hold is left.
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

from .. import device_fault
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
        #: whether ``data`` is pinned (kept here: asking CUDA fails once its context broke)
        self.pinned = False
        #: the asynchronous copy in flight: a :class:`_DeviceCopy` or a :class:`_ThreadCopy`
        self._event: Any = None
        self._pending_step: int | None = None
        self._copier: HostCopier | None = None  # set before any copy is handed to it
        #: readers on other threads (see :meth:`hold`), counted under ``_unheld``
        self._holds = 0
        self._unheld = threading.Condition()

    # ---------------------------------------------------------------- state

    @property
    def complete(self) -> bool:
        """Whether the snapshot holds a whole state (polls an asynchronous copy)."""
        if self._event is not None and self._event.query():
            self._finish_async()
        return self.step is not None

    @property
    def in_flight(self) -> bool:
        """Whether a copy into the buffer may still be running (never waits)."""
        return self._event is not None

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
        if not event.intact():
            return
        self.step = step

    def hold(self) -> None:
        """Keeps the (complete) snapshot as it is until :meth:`unhold`: a thread
        other than the training thread reads it meanwhile."""
        assert self.step is not None and self._event is None, "only a landed snapshot is held"
        with self._unheld:
            self._holds += 1

    def unhold(self) -> None:
        with self._unheld:
            self._holds -= 1
            if not self._holds:
                self._unheld.notify_all()

    @property
    def held(self) -> bool:
        return self._holds > 0

    def _wait_unheld(self) -> None:
        # Invariant: nothing changes a held snapshot (every change comes through
        # invalidate()). A reader holds it for one memory copy of its bytes (one
        # handed over at a flush or the call's end: also while the write before
        # it ends); the wait is chunked so that an asynchronous exception (a
        # restart) gets in, before anything was changed.
        with self._unheld:
            while self._holds:
                self._unheld.wait(0.05)

    def invalidate(self) -> None:
        """Marks the snapshot incomplete; first thing before its buffer is overwritten.

        Waits for the readers that hold it first (they read its step and layout
        too). Never raises for a CUDA context that broke: the copy that may
        still write into the buffer is abandoned with the buffer (see
        :mod:`inprocess.device_fault`).
        """
        # (read without the lock: holds are taken on the thread that changes the
        # snapshot, so a stale count is one already let go, and the wait sees it)
        if self._holds:
            self._wait_unheld()
        self.step = None
        self._pending_step = None
        if self._event is not None:
            # an in-flight copy still writes into the buffer: let it land first
            event, self._event = self._event, None
            try:
                event.synchronize()
            except Exception as ex:
                device_fault.mark_broken(device_fault.cause_of(ex) or repr(ex))
                self._abandon()
        elif self._copier is not None:
            # a copy handed to the thread by a fill that an exception interrupted
            # before it kept the copy's handle: the thread's queue is in order
            self._copier.drain()

    def release(self) -> None:
        self.invalidate()
        if self.pinned and device_fault.broken() is not None:
            self._abandon()
        self.data, self.pinned = torch.empty(0, dtype=torch.uint8), False
        self.skeleton, self.refs, self.offsets, self.ranges, self.nbytes = {}, [], [], {}, 0

    def _abandon(self) -> None:
        """Gives the buffer up without freeing it: freeing pinned memory records an
        event, which on a broken CUDA context aborts the process."""
        device_fault.keep(self.data)
        self.data, self.pinned = torch.empty(0, dtype=torch.uint8), False

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

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Makes the buffer hold at least ``nbytes`` (pinned if asked): ahead of a
        copy, so that allocating it (pinning is about 0.7 s per GB) is not
        paid inside a later step."""
        if self.data.numel() >= nbytes and (not pin or self.pinned):
            return
        capacity = max(nbytes, 1)
        if pin:
            self.data = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        else:
            self.data = torch.empty(capacity, dtype=torch.uint8)
        self.pinned = pin

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
        device: DeviceCopier | None = None,
    ) -> None:
        """Copies ``state`` in: CUDA tensors on a side stream (by ``device``, or,
        without one, with the training stream waiting for the copy at once),
        host tensors on ``copier``'s thread or, without one, here; the snapshot
        completes when the copy lands."""
        skeleton, tensors = layout.capture(state)
        self.invalidate()
        self.shard = shard
        self._plan(skeleton)
        on_cuda = any(t.is_cuda for t in tensors)
        self.reserve(self.nbytes, pin=on_cuda and torch.cuda.is_available())
        self._zero_padding()
        self.skeleton = {
            k: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for k, v in skeleton.items()
        }
        views = self.views()
        if on_cuda:
            self._pending_step = step
            self._event = (device or DeviceCopier(synchronous=True)).submit(
                views, self.offsets, self.nbytes, tensors
            )
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
        self.reserve(self.nbytes, pin=False)
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


def use_staging(setting: bool | None, nbytes: int, free: int, total: int) -> bool:
    """Whether a device copy stages the state on the GPU first.

    ``setting`` is the user's (``None``: decide). Staging takes ``nbytes`` of
    device memory for as long as the call runs, so it is used only where the
    device has that free (outside the caching allocator's reserve, which holds
    the training's own peak by the first commit) with a tenth of the device
    to spare.
    """
    if setting is not None:
        return setting
    return free >= nbytes + total // 10


class _DeviceCopy:
    """One snapshot's copy from the GPU, in flight on the side stream; event-like
    (``query``, ``synchronize``, ``intact``) as :class:`HostSnapshot` expects.

    A copy not ``fenced`` at once reads the state itself while training goes
    on: until the training stream waits for it (:meth:`fence`), the sources
    are kept alive here (the allocator must not hand their memory out; no
    ``record_stream``, which makes freeing that memory a CUDA call) and their
    version counters are compared when the copy is fenced or seen landed.
    """

    def __init__(
        self, copier: DeviceCopier, done: Any, sources: list[torch.Tensor], fenced: bool
    ) -> None:
        self._copier = copier
        self._done = done
        self._sources = [] if fenced else sources
        self._versions = [] if fenced else [t._version for t in sources]
        self.fenced = fenced
        self.torn = False

    def query(self) -> bool:
        return bool(self._done.query())

    def synchronize(self) -> None:
        self._done.synchronize()

    def fence(self) -> None:
        """Makes the current stream wait for the copy before anything queued after
        this call: the optimizer step that is about to change the state."""
        if self.fenced:
            return
        self._check_sources()
        torch.cuda.current_stream().wait_event(self._done)
        self.fenced = True

    def intact(self) -> bool:
        """Whether the copy holds the state of its commit (call once it landed)."""
        if not self.fenced:
            # Not fenced yet: anything that changed a source since the commit may
            # have run beside the copy (conservative: it may also have run after).
            self._check_sources()
        self._sources = []
        return not self.torn

    def _check_sources(self) -> None:
        changed = [
            i for i, (t, v) in enumerate(zip(self._sources, self._versions, strict=True))
            if t._version != v
        ]
        self._sources, self._versions = [], []
        if changed:
            self.torn = True
            self._copier.torn(len(changed))


class DeviceCopier:
    """Copies CUDA state into host snapshots on a side stream, beside training.

    Where the training stream waits (the policy, in one place):

    * **Staged** (the default where the device has room, :func:`use_staging`):
      the state is first copied on the device into a staging buffer (HBM
      bandwidth: about a millisecond per GB on an H100), the training stream
      waits only for that, and the PCIe copy to the pinned host buffer runs
      from the staging buffer while the next steps run. Nothing the training
      does can tear it.
    * **Fenced at the optimizer step** (no room for staging): the PCIe copy
      reads the state itself; the forward and backward passes run beside it
      and the training stream waits for it only at the next optimizer step (a
      global optimizer-step pre-hook). A source changed before that (an
      in-place update outside the optimizer step: batch-norm statistics, a
      user's own) is caught by its version counter: that snapshot is
      discarded, never restored, and the copier turns synchronous.
    * **Synchronous**: the training stream waits for the whole copy at once
      (the ring exchange of ``replicated=False``, and after a torn copy).

    A commit that arrives while the previous copy is still in flight
    (:meth:`busy`) is coalesced by the caller: it is skipped, and the next
    commit after the copy landed takes the newer state. Training never waits
    for PCIe then; a fault redoes the steps since the newest landed copy (at
    most about ``copy time / step time + 1``).
    """

    def __init__(self, staging: bool | None = None, synchronous: bool = False) -> None:
        self.staging = staging
        self.synchronous = synchronous
        #: commits skipped because the previous copy was still in flight
        self.coalesced = 0
        self._in_flight: list[_DeviceCopy] = []
        self._stage: torch.Tensor | None = None
        #: the size staging was refused at (``use_staging``): not asked again for it
        self._no_stage_at: int | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------ decisions

    def busy(self) -> bool:
        """Whether a copy of this copier has not landed yet (never waits)."""
        self._in_flight = [c for c in self._in_flight if not c.query()]
        return bool(self._in_flight)

    def _staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        if self.synchronous or self.staging is False:
            return None
        stage = self._stage
        if stage is not None and stage.numel() >= nbytes and stage.device == device:
            return stage
        if self._no_stage_at == nbytes:
            return None
        free, total = torch.cuda.mem_get_info(device)
        if stage is not None:
            free += stage.numel()
        if not use_staging(self.staging, nbytes, free, total):
            self._no_stage_at = nbytes
            log.info(
                "snapshots of %.2f GB are copied without staging: %.2f GB free on %s "
                "(the optimizer step waits for each copy)",
                nbytes / 1e9, free / 1e9, device,
            )
            return None
        if stage is not None:
            # a copy in flight may still read the old buffer
            _side_stream().synchronize()
            self._stage = stage = None
        try:
            # allocated on the side stream: its memory is reused only by that stream
            with torch.cuda.stream(_side_stream()):
                stage = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            self._no_stage_at = nbytes
            log.info("no room on %s to stage snapshots of %.2f GB", device, nbytes / 1e9)
            return None
        self._stage = stage
        return stage

    # ------------------------------------------------------------ copying

    def submit(
        self,
        views: list[torch.Tensor],
        offsets: list[int],
        nbytes: int,
        tensors: list[torch.Tensor],
    ) -> _DeviceCopy:
        """Starts copying ``tensors`` into ``views`` (host, pinned; at ``offsets``
        of a ``nbytes`` buffer); host tensors are copied here, at once."""
        on_cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
        current = torch.cuda.current_stream()
        device = current.device
        stage = None
        if all(tensors[i].device == device for i in on_cuda):
            stage = self._staging_buffer(nbytes, device)
        stream = _side_stream()
        # Invariant: the side stream starts after every kernel queued so far on
        # the current stream (the state is final), and the current stream waits
        # for `fence` before anything that changes the state (at once, or at the
        # optimizer step: `fence()`).
        stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(stream):
            fence = None
            if stage is not None:
                staged = []
                for i in on_cuda:
                    t, n = tensors[i], views[i].numel() * views[i].element_size()
                    view = stage[offsets[i] : offsets[i] + n].view(t.dtype).view(t.shape)
                    view.copy_(t)
                    staged.append(view)
                fence = torch.cuda.Event()
                fence.record(stream)
                for i, view in zip(on_cuda, staged, strict=True):
                    views[i].copy_(view, non_blocking=True)
            else:
                for i in on_cuda:
                    views[i].copy_(tensors[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        for i, t in enumerate(tensors):
            if not t.is_cuda:
                views[i].copy_(t)
        at_once = stage is not None or self.synchronous
        if at_once:
            current.wait_event(fence if fence is not None else done)
        copy = _DeviceCopy(self, done, [tensors[i] for i in on_cuda], fenced=at_once)
        if not at_once:
            self._hook_optimizer()
        self._in_flight.append(copy)
        return copy

    def fence_all(self) -> None:
        """Fences every copy in flight (the optimizer-step pre-hook)."""
        for copy in self._in_flight:
            copy.fence()

    def torn(self, n: int) -> None:
        if not self.synchronous:
            self.synchronous = True
            log.warning(
                "a snapshot's source changed on the GPU while it was copied (%d tensors "
                "modified in place outside the optimizer step, before the next commit): "
                "that snapshot is discarded and later commits make training wait for "
                "their copy",
                n,
            )

    def _hook_optimizer(self) -> None:
        if self._finalizer is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # the hook holds the copier weakly: a copier never closed is still collected
        hook = register_optimizer_step_pre_hook(
            functools.partial(_fence_before_step, weakref.ref(self))
        )
        self._finalizer = weakref.finalize(self, hook.remove)

    def close(self) -> None:
        """Waits for the copies in flight, removes the hook, frees the staging
        buffer. Never raises for a CUDA context that broke (it is recorded)."""
        copies, self._in_flight = self._in_flight, []
        for copy in copies:
            try:
                copy.synchronize()
            except Exception as ex:
                device_fault.mark_broken(device_fault.cause_of(ex) or repr(ex))
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        if self._stage is not None and device_fault.broken() is not None:
            device_fault.keep(self._stage)
        self._stage = None


def _fence_before_step(ref: weakref.ref[DeviceCopier], _optimizer: Any, _a: Any, _k: Any) -> None:
    copier = ref()
    if copier is not None and copier._in_flight:
        copier.fence_all()


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
