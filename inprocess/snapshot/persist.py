"""Snapshots on disk, for what memory cannot cover: a cold restart, every holder lost.

Every ``persist_every``-th committed snapshot is written by a background
thread with ``torch.distributed.checkpoint`` (``no_dist``: each shard is a
checkpoint of its own, loadable without this library), from a private copy
of the snapshot (the host slots keep being reused meanwhile)::

    <snapshot_dir>/step-00000120/shard-0/            the DCP checkpoint
    <snapshot_dir>/step-00000120/shard-0.done.json   its completion marker

The marker is written (atomically: a temporary file renamed, then fsynced)
only once the checkpoint is entirely on disk: a step directory without it, a
write torn by a crash, is never loaded. The marker carries the skeleton
(so a restore knows the layout before reading) and per-key checksums.

Replicated state: only rank 0 writes (shard 0). One write at a time, and at
most one waiting behind it (the newest due): training never waits for the
disk. After each write, the two newest steps complete on every shard are
kept, and anything newer; older steps are removed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from typing import Any

from . import layout
from .buffers import HostSnapshot

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MARKER = re.compile(r"^shard-(\d+)\.done\.json$")
#: complete steps kept on disk
KEEP = 2


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_dir(root: str, step: int, shard: int) -> str:
    return os.path.join(step_dir(root, step), f"shard-{shard}")


def marker_path(root: str, step: int, shard: int) -> str:
    return os.path.join(step_dir(root, step), f"shard-{shard}.done.json")


def complete(root: str | None) -> set[tuple[int, int]]:
    """``(shard, step)`` of every complete snapshot under ``root``."""
    if root is None:
        return set()
    out = set()
    try:
        steps = os.listdir(root)
    except OSError:
        return out
    for name in steps:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        with contextlib.suppress(OSError):
            for entry in os.listdir(os.path.join(root, name)):
                mm = _MARKER.match(entry)
                if mm:
                    out.add((int(mm.group(1)), int(m.group(1))))
    return out


def read(root: str, step: int, shard: int, into: HostSnapshot) -> int:
    """Loads a complete persisted snapshot into ``into``; returns the bytes read."""
    import torch.distributed.checkpoint as dcp

    with open(marker_path(root, step, shard)) as f:
        marker = json.load(f)
    skeleton = {k: base64.b64decode(v) for k, v in marker["skeleton"].items()}
    import pickle

    refs = [r for v in skeleton.values() for r in layout.refs(pickle.loads(v)[1])]
    into.assign(step, shard, skeleton, refs)
    views = into.views()
    template = {k: layout.fill(kv[1], views) for k, kv in into.unpickled().items()}
    dcp.load(template, checkpoint_id=shard_dir(root, step, shard), no_dist=True)
    # plain values come back from the checkpoint as it stored them; the skeleton has them too
    into.seal()
    return into.nbytes


class Persister:
    """Writes snapshots to disk in a background thread, one at a time.

    Invariant (under ``_cond``): at most one snapshot waits behind the one
    being written; a newer one replaces it (its private copy is dropped), so
    a disk slower than ``persist_every`` steps writes the newest due snapshot
    next, never an ever-growing queue, and training never waits for it.
    """

    def __init__(self, root: str, every: int) -> None:
        self.root = root
        self.every = every
        self._cond = threading.Condition()
        self._pending: tuple[HostSnapshot, int, bool] | None = None
        self._writing = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self.skipped = 0
        self.last_error: BaseException | None = None
        self.written: list[int] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def submit(self, snapshot: HostSnapshot, world_size: int, replicated: bool) -> None:
        """Queues a private copy of ``snapshot`` for writing (replacing one still waiting)."""
        snapshot.wait()
        copy = HostSnapshot()
        copy.copy_from(snapshot)  # the slots are reused meanwhile
        with self._cond:
            if self._pending is not None:
                self.skipped += 1
                log.info(
                    "snapshot of step %s not persisted: the disk is behind (newer one queued)",
                    self._pending[0].step,
                )
                self._pending[0].release()
            self._pending = (copy, world_size, replicated)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="inprocess-snapshot-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._writing = True
            try:
                self._write(*job)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, snap: HostSnapshot, world_size: int, replicated: bool) -> None:
        import torch.distributed.checkpoint as dcp

        step, shard = snap.step, snap.shard
        assert step is not None
        try:
            started = time.monotonic()
            views = snap.views()
            state = {k: layout.fill(kv[1], views) for k, kv in snap.unpickled().items()}
            path = shard_dir(self.root, step, shard)
            if os.path.exists(marker_path(self.root, step, shard)):
                os.unlink(marker_path(self.root, step, shard))  # rewritten: incomplete meanwhile
            os.makedirs(path, exist_ok=True)
            dcp.save(state, checkpoint_id=path, no_dist=True)
            _fsync_tree(path)
            marker = {
                "step": step,
                "shard": shard,
                "world_size": world_size,
                "replicated": replicated,
                "bytes": snap.nbytes,
                "time": time.time(),
                "checksums": snap.checksums(),
                "skeleton": {k: base64.b64encode(v).decode() for k, v in snap.skeleton.items()},
            }
            _atomic_json(marker_path(self.root, step, shard), marker)
            self.written.append(step)
            log.debug(
                "persisted step %d shard %d in %.3fs", step, shard, time.monotonic() - started
            )
            # Every writer prunes after its write: the last shard of a step to land
            # sees the step whole (concurrent prunes remove the same directories).
            self._prune(1 if replicated else world_size)
        except Exception as ex:  # a thread's error is reported, never raised into training
            self.last_error = ex
            log.warning("persisting the snapshot of step %s failed: %r", step, ex)
        finally:
            snap.release()

    def _prune(self, shards: int) -> None:
        """Keeps the ``KEEP`` newest whole steps (every shard complete) and what is newer.

        Older steps go, incomplete ones too: a step older than a whole one is
        never written any more (each rank writes its steps in order), and one
        left incomplete (a rank's write skipped while its disk was behind) can
        never be restored.
        """
        done: dict[int, set[int]] = {}
        for shard, step in complete(self.root):
            done.setdefault(step, set()).add(shard)
        whole = sorted(s for s, have in done.items() if len(have) >= shards)
        if not whole:
            return
        keep = set(whole[-KEEP:])
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and int(m.group(1)) < whole[-1] and int(m.group(1)) not in keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything queued is on disk; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Writes what is queued (a call ends with its last due snapshot on disk), then
        stops the thread."""
        if not self.flush(timeout):
            log.warning("the snapshot writer did not finish within %ss", timeout)
        with self._cond:
            self._closing = True
            if self._pending is not None:
                self._pending[0].release()
                self._pending = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def _atomic_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with contextlib.suppress(OSError), open(full, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


__all__ = ["Persister", "complete", "read"]
