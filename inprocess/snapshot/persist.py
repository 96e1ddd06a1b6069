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

Replicated state: only rank 0 writes (shard 0). One write at a time: a
persist due while the previous one is still writing is skipped (logged), so
training never waits for the disk. Rank 0 keeps the two newest complete steps
and removes older ones.
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
    """Writes snapshots to disk in a background thread, one at a time."""

    def __init__(self, root: str, every: int) -> None:
        self.root = root
        self.every = every
        self._thread: threading.Thread | None = None
        self._skipped = 0
        self.last_error: BaseException | None = None
        self.written: list[int] = []

    def due(self, commits: int) -> bool:
        return commits % self.every == 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, snapshot: HostSnapshot, world_size: int, replicated: bool, prune: bool
    ) -> bool:
        """Starts writing a copy of ``snapshot``; ``False`` when a write is still running."""
        if self.busy:
            self._skipped += 1
            log.warning(
                "snapshot of step %s not persisted: the previous write is still running "
                "(%d skipped so far; persist_every may be too small for this disk)",
                snapshot.step,
                self._skipped,
            )
            return False
        snapshot.wait()
        copy = HostSnapshot()
        copy.copy_from(snapshot)  # a private copy: the slots are reused meanwhile
        self._thread = threading.Thread(
            target=self._write,
            args=(copy, world_size, replicated, prune),
            name="inprocess-snapshot-writer",
            daemon=True,
        )
        self._thread.start()
        return True

    def _write(self, snap: HostSnapshot, world_size: int, replicated: bool, prune: bool) -> None:
        import torch.distributed.checkpoint as dcp

        step, shard = snap.step, snap.shard
        assert step is not None
        try:
            started = time.monotonic()
            views = snap.views()
            state = {k: layout.fill(kv[1], views) for k, kv in snap.unpickled().items()}
            path = shard_dir(self.root, step, shard)
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
            if prune:
                self._prune(world_size if not replicated else 1)
        except BaseException as ex:  # a thread's error is reported, never raised into training
            self.last_error = ex
            log.warning("persisting the snapshot of step %s failed: %r", step, ex)
        finally:
            snap.release()

    def _prune(self, shards: int) -> None:
        """Removes steps older than the ``KEEP`` newest complete ones (all shards done)."""
        done: dict[int, set[int]] = {}
        for shard, step in complete(self.root):
            done.setdefault(step, set()).add(shard)
        whole = sorted(s for s, have in done.items() if len(have) >= shards)
        if len(whole) <= KEEP:
            return
        oldest_kept = whole[-KEEP]
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and int(m.group(1)) < oldest_kept:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def close(self, timeout: float | None = None) -> None:
        """Waits for a write in flight (a call ends with its last snapshot on disk)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the snapshot writer did not finish within %ss", timeout)
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
