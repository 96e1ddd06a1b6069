"""Host buffers of snapshots: one flat byte buffer per snapshot, reused, double-buffered.

A :class:`HostSnapshot` holds one state at one step: its skeleton (pickled per
key) and every tensor's bytes in one flat ``uint8`` buffer, each tensor at an
aligned offset. The buffer is reused from commit to commit (reallocated only
when the state grows), pinned when the state has CUDA tensors.

A snapshot equals the state at its commit by construction, whatever idiom
changes the state afterwards (an optimizer, ``.data``, a numpy view of the
same memory, ``no_grad``): nothing that runs after the commit can write into
the state before the copy has read it. Host tensors are copied inside
``commit``, before it returns (a memory copy: about 0.1 s per GB on one
core); CUDA tensors are copied by a :class:`DeviceCopier` on a side stream
that starts after every kernel queued so far, and the training stream waits
for that copy (or, staged, for its device-to-device half only) before any
kernel queued after the commit. Tensor version counters are not relied on:
writes through ``.data`` or a numpy view do not move them.

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

import logging
import pickle
import threading
import zlib
from collections.abc import Mapping
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
        #: the asynchronous (CUDA) copy in flight: a :class:`_DeviceCopy`
        self._event: Any = None
        self._pending_step: int | None = None
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
        device: DeviceCopier | None = None,
    ) -> None:
        """Copies ``state`` in: host tensors here, before returning; CUDA tensors on a
        side stream (by ``device``, or, without one, with the training stream
        waiting for the whole copy); the snapshot completes when the copy lands."""
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
            self._event = (device or DeviceCopier(staging=False)).submit(
                views, self.offsets, self.nbytes, tensors
            )
            return
        copy_host(views, tensors)
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


def copy_host(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copies each source into its view, here and now (host tensors; a subclass's
    ``__torch_function__`` runs as it would for any copy)."""
    with torch.no_grad():
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)


class _DeviceCopy:
    """One snapshot's copy from the GPU, in flight on the side stream; event-like
    (``query``, ``synchronize``, ``intact``) as :class:`HostSnapshot` expects."""

    def __init__(self, done: Any) -> None:
        self._done = done

    def query(self) -> bool:
        return bool(self._done.query())

    def synchronize(self) -> None:
        self._done.synchronize()

    def intact(self) -> bool:
        """The copy holds the state of its commit by construction (the training
        stream waited for it); a copy that failed raised instead."""
        return True


class DeviceCopier:
    """Copies CUDA state into host snapshots on a side stream, beside training.

    The side stream starts after every kernel queued on the training stream
    before the commit, and the training stream waits, before any kernel queued
    after it, for (the policy, in one place):

    * **Staged** (the default where the device has room, :func:`use_staging`):
      the state's copy into a staging buffer on the device (HBM bandwidth:
      about a millisecond per GB on an H100); the PCIe copy to the pinned host
      buffer then runs from the staging buffer while the next steps run.
    * **Not staged** (no room, ``snapshot_staging=False``, the ring exchange of
      ``replicated=False``): the whole copy to the host.

    Either way nothing the training does after the commit (an optimizer step,
    a write through ``.data``, batch-norm statistics in the forward pass) can
    change the state before the copy read it: the snapshot is the state at
    the commit by construction.

    A commit that arrives while the previous copy is still in flight
    (:meth:`busy`) is coalesced by the caller: it is skipped, and the next
    commit after the copy landed takes the newer state. A fault redoes the
    steps since the newest landed copy (at most about
    ``copy time / step time + 1``).
    """

    def __init__(self, staging: bool | None = None) -> None:
        self.staging = staging
        #: commits skipped because the previous copy was still in flight
        self.coalesced = 0
        self._in_flight: list[_DeviceCopy] = []
        self._stage: torch.Tensor | None = None
        #: the size staging was refused at (``use_staging``): not asked again for it
        self._no_stage_at: int | None = None

    # ------------------------------------------------------------ decisions

    def busy(self) -> bool:
        """Whether a copy of this copier has not landed yet (never waits)."""
        self._in_flight = [c for c in self._in_flight if not c.query()]
        return bool(self._in_flight)

    def _staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        if self.staging is False:
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
                "(training waits for each copy to the host)",
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
        # for `fence` before any kernel queued after this call: nothing can
        # change a source before the copy has read it.
        stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(stream):
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
        on_host = [i for i, t in enumerate(tensors) if not t.is_cuda]
        copy_host([views[i] for i in on_host], [tensors[i] for i in on_host])
        current.wait_event(fence if stage is not None else done)
        copy = _DeviceCopy(done)
        self._in_flight.append(copy)
        return copy

    def close(self) -> None:
        """Waits for the copies in flight, frees the staging buffer. Never raises
        for a CUDA context that broke (it is recorded)."""
        copies, self._in_flight = self._in_flight, []
        for copy in copies:
            try:
                copy.synchronize()
            except Exception as ex:
                device_fault.mark_broken(device_fault.cause_of(ex) or repr(ex))
        if self._stage is not None and device_fault.broken() is not None:
            device_fault.keep(self._stage)
        self._stage = None


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
