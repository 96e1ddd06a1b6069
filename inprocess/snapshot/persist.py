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
(so a restore knows the layout before reading), per-key checksums, a SHA-256
of each of the checkpoint's metadata files, and a MAC over all of it under
the directory's marker key (``<snapshot_dir>/.marker-key``: random, made by
the first writer, mode 0600, checked like every file). The key lives with the
snapshots, not with the job: a later launch (another job secret) restores
them; what they come from is established by ownership, not by the key.

What a restore trusts (see docs/reliability-and-security.md, "What the job trusts
on disk"): ``snapshot_dir``
and every step below it must be owned by this user and not writable by group
or others, with no symlink below it (:func:`scan` refuses anything else by
name, :class:`SnapshotTrustError`, before a byte of it is read: the skeleton
and the checkpoint's ``.metadata`` are pickles). A marker whose MAC does not
verify is never unpickled, its step never loaded; the metadata files must
match their hashes before ``torch.distributed.checkpoint`` unpickles them;
and what was read must match the marker's checksums (:func:`read` raises
:class:`Unusable` otherwise), else the restore falls back to an older step.

Replicated state: only rank 0 writes (shard 0). One write at a time, and at
most one waiting behind it (the newest due): training never waits for the
disk. After each write, the two newest steps complete on every shard are
kept, and anything newer; older steps are removed.

Every marker names the *lineage* its step was committed in: an id the ranks
agree on at each restore, so the shards of one step written by two runs (or
by two trajectories of one run, before and after a restore went back) are
told apart: a step is whole only when all its shards share a lineage (see
:func:`inprocess.snapshot.policy.screen`). A restore that goes back to step
``s`` fences what is newer (:meth:`Persister.fence`, :func:`fence`): no
marker of a step after ``s`` from an earlier lineage lands or stays.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from typing import Any

from .. import persist_signal, security
from ..exception import RestartAbort
from ..ownership import distrust
from . import layout
from .buffers import HostSnapshot

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MARKER = re.compile(r"^shard-(\d+)\.done\.json$")
_SHARD_DIR = re.compile(r"^shard-(\d+)$")
#: complete steps kept on disk
KEEP = 2
#: what a marker's MAC is bound to (with its step and shard)
_MAC_NAME = "inprocess/snapshot-marker/v1/step-{step:08d}/shard-{shard}"
#: the markers' MAC key, in ``snapshot_dir``
KEY_FILE = ".marker-key"
#: the checkpoint's data files: verified by the marker's checksums once read
_DATA_SUFFIX = ".distcp"
#: the largest marker read (a skeleton of plain values; a bigger file is not one of ours)
_MARKER_MAX = 256 << 20
#: how the key and the markers are opened: never through a symlink, never blocking
#: (a FIFO put in a file's place; what is opened is checked on its descriptor)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class SnapshotTrustError(RestartAbort):
    """``snapshot_dir``, or something below it, could have been written by another user.

    Nothing of it is read (it could run that user's code) nor written; raised on
    every rank by ``restore`` (and by ``commit`` on the rank that persists), it
    ends the Wrapper: a restart would find the same directory.
    """


class SnapshotCorrupt(RestartAbort):
    """Snapshots were on disk but none of them is intact (nor in memory): nothing restored.

    Raised on every rank by ``restore``; it ends the Wrapper rather than start
    the training over from step 0 behind the user's back.
    """


class Unusable(Exception):
    """A persisted snapshot that failed its checks while it was read (the reason)."""


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.distributed.checkpoint`` raises for a file it cannot read or write:
    its ``CheckpointException`` is a ``BaseException``, not an ``Exception``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_dir(root: str, step: int, shard: int) -> str:
    return os.path.join(step_dir(root, step), f"shard-{shard}")


def marker_path(root: str, step: int, shard: int) -> str:
    return os.path.join(step_dir(root, step), f"shard-{shard}.done.json")


# ------------------------------------------------------------------ trust


_ADVICE = (
    "nothing another user could have written is read or written (it could run "
    "that user's code as this one): make it ours and private (chown, chmod go-w) "
    "or choose another snapshot_dir"
)


def check_root(root: str) -> bool:
    """Refuses a ``snapshot_dir`` another user owns or may write to; ``False``: none.

    A symlink is followed only when it is ours (the directory it names is
    checked the same way).

    Raises:
        SnapshotTrustError: naming the directory and the reason.
    """
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        if info.st_uid != os.getuid():
            raise SnapshotTrustError(
                f"snapshot_dir {root} is a symlink owned by uid {info.st_uid}, not by this "
                f"user ({os.getuid()}); {_ADVICE}"
            )
        try:
            info = os.stat(root)
        except FileNotFoundError:
            return False
    if not stat.S_ISDIR(info.st_mode):
        raise SnapshotTrustError(f"snapshot_dir {root} is not a directory")
    reason = distrust(info)
    if reason is not None:
        raise SnapshotTrustError(f"snapshot_dir {root} {reason}; {_ADVICE}")
    return True


def prepare(root: str) -> None:
    """Creates ``snapshot_dir`` private (mode 0700) if it is missing, then checks it.

    Raises:
        SnapshotTrustError: see :func:`check_root`.
        OSError: it cannot be created.
    """
    if not os.path.lexists(root):
        with contextlib.suppress(FileExistsError):  # (made meanwhile: checked below)
            os.makedirs(root, mode=0o700)
    if not check_root(root):
        raise FileNotFoundError(f"snapshot_dir {root} does not exist (a dangling symlink?)")


def _check_below(root: str, path: str, info: os.stat_result, kind: str) -> None:
    reason = distrust(info)
    if reason is None:
        wanted = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
        if not wanted(info.st_mode):
            reason = f"is not a {kind}"
    if reason is not None:
        raise SnapshotTrustError(f"snapshot_dir {root}: {path} {reason}; {_ADVICE}")


def _check_step(root: str, step_path: str) -> list[str]:
    """Refuses a step directory with anything untrusted in it; returns its entries."""
    _check_below(root, step_path, os.lstat(step_path), "directory")
    entries = sorted(os.listdir(step_path))
    for entry in entries:
        path = os.path.join(step_path, entry)
        info = os.lstat(path)
        if _SHARD_DIR.match(entry) and not stat.S_ISLNK(info.st_mode):
            _check_below(root, path, info, "directory")
            for name in sorted(os.listdir(path)):
                inner = os.path.join(path, name)
                _check_below(root, inner, os.lstat(inner), "regular file")
        else:
            _check_below(root, path, info, "regular file")
    return entries


# ------------------------------------------------------------------ markers


def _mac_text(marker: dict[str, Any]) -> str:
    body = {k: v for k, v in marker.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def marker_key(root: str, create: bool = False) -> str | None:
    """The markers' MAC key of ``root`` (made first when ``create``); ``None``: none yet.

    Made by the first writer: written to a private temporary file, then linked
    into place (atomic: of writers racing, the first link stands). Opened with
    ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO in its place never blocks the
    open) and checked on its descriptor before a byte is read: ours, a regular
    file, mode 0600 or stricter.

    Raises:
        SnapshotTrustError: the key file is not ours, not private, or not a key.
    """
    path = os.path.join(root, KEY_FILE)
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        if not create:
            return None
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
        _fsync_dir(root)
        fd = os.open(path, _READ_FLAGS)
    except OSError as ex:  # ELOOP: a symlink
        raise SnapshotTrustError(
            f"snapshot_dir {root}: {path} cannot be used: {ex}; {_ADVICE}"
        ) from ex
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        reason = distrust(info)
        if reason is None and (not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077):
            reason = f"is not a private regular file (mode {stat.S_IMODE(info.st_mode):o})"
        key = f.read(129).strip() if reason is None else ""
    if reason is None and not re.fullmatch(r"[0-9a-f]{64}", key):
        reason = "is not a key of this library"
    if reason is not None:
        raise SnapshotTrustError(f"snapshot_dir {root}: {path} {reason}; {_ADVICE}")
    return key


def _read_regular(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``, a regular file (checked on its descriptor:
    a FIFO or a device swapped in after a check is refused, never waited on)."""
    fd = os.open(path, _READ_FLAGS)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read(limit)


def _sign(marker: dict[str, Any], key: str) -> dict[str, Any]:
    name = _MAC_NAME.format(step=marker["step"], shard=marker["shard"])
    return {**marker, "mac": security.mac(name, _mac_text(marker), secret=key)}


def _authentic(marker: Any, step: int, shard: int, key: str | None) -> str | None:
    """Why ``marker`` (read from step ``step``, shard ``shard``) is not ours; ``None``: it is."""
    if not isinstance(marker, dict) or not isinstance(marker.get("mac"), str):
        return "its completion marker carries no MAC: not written by this library's writer"
    if key is None:
        return f"the directory has no marker key ({KEY_FILE}): not written by this library"
    expected = security.mac(
        _MAC_NAME.format(step=step, shard=shard), _mac_text(marker), secret=key
    )
    if not hmac.compare_digest(marker["mac"].encode(), expected.encode()):
        return (
            f"its completion marker's MAC does not verify under the directory's {KEY_FILE}: "
            "forged, or changed since it was written"
        )
    if marker.get("step") != step or marker.get("shard") != shard:
        return "its completion marker names another step or shard"
    for field in ("checksums", "skeleton", "metadata"):
        if not isinstance(marker.get(field), dict):
            return f"its completion marker has no {field!r}"
    if set(marker["checksums"]) != set(marker["skeleton"]):
        return "its completion marker's checksums do not cover its keys"
    return None


@dataclasses.dataclass
class Scan:
    """What ``snapshot_dir`` offers: ``complete`` maps ``(shard, step)`` to its
    authentic marker; ``rejected`` lists ``(shard, step, reason)`` of markers
    that are not (never unpickled, never loaded)."""

    complete: dict[tuple[int, int], dict[str, Any]] = dataclasses.field(default_factory=dict)
    rejected: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)


def scan(root: str | None) -> Scan:
    """The persisted snapshots under ``root``, every file of each step checked first.

    Raises:
        SnapshotTrustError: ``root`` or anything in a step directory is not
            ours, is writable by others, is a symlink (see the module's doc).
    """
    out = Scan()
    if root is None or not check_root(root):
        return out
    try:
        names = sorted(os.listdir(root))
    except OSError as ex:
        log.warning("cannot list snapshot_dir %s: %s", root, ex)
        return out
    key = marker_key(root) if any(_STEP_DIR.match(n) for n in names) else None
    for name in names:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        step, step_path = int(m.group(1)), os.path.join(root, name)
        try:
            entries = _check_step(root, step_path)
        except FileNotFoundError:
            continue  # removed meanwhile (a writer's prune)
        except OSError as ex:
            log.warning("cannot read %s: %s", step_path, ex)
            continue
        for entry in entries:
            mm = _MARKER.match(entry)
            if not mm:
                continue
            shard = int(mm.group(1))
            try:
                raw = _read_regular(os.path.join(step_path, entry), _MARKER_MAX + 1)
                marker = json.loads(raw) if len(raw) <= _MARKER_MAX else None
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as ex:
                out.rejected.append((shard, step, f"its completion marker is unreadable: {ex}"))
                continue
            reason = _authentic(marker, step, shard, key)
            if reason is None:
                out.complete[(shard, step)] = marker
            else:
                out.rejected.append((shard, step, reason))
    return out


def layout_of(marker: dict[str, Any]) -> int | None:
    """How many shards the step of ``marker`` has: 1 for replicated state, else the
    world size it was committed at (``None``: the marker does not say)."""
    if marker.get("replicated") is True:
        return 1
    world = marker.get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) else None


def fence(root: str | None, step: int, shards: frozenset[int] | None = None) -> list[int]:
    """Removes the completion markers of every step after ``step`` (of ``shards``
    only, if given): a restore went back before them, their trajectory is
    abandoned. Returns the steps fenced. Their files stay until a prune."""
    fenced = []
    if root is None or not os.path.isdir(root):
        return fenced
    for name in sorted(os.listdir(root)):
        m = _STEP_DIR.match(name)
        if not m or int(m.group(1)) <= step:
            continue
        path = os.path.join(root, name)
        try:
            entries = os.listdir(path)
        except OSError:
            continue
        for entry in entries:
            mm = _MARKER.match(entry)
            if mm and (shards is None or int(mm.group(1)) in shards):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(path, entry))
                    fenced.append(int(m.group(1)))
    if fenced:
        _fsync_dir(root)
    return sorted(set(fenced))


def complete(root: str | None) -> set[tuple[int, int]]:
    """``(shard, step)`` of every complete snapshot under ``root`` with an authentic marker."""
    return set(scan(root).complete)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with os.fdopen(os.open(path, _READ_FLAGS), "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _metadata_files(path: str) -> dict[str, str]:
    """SHA-256 of each file of a checkpoint but its data files: the pickles DCP loads."""
    return {
        name: _sha256(os.path.join(path, name))
        for name in sorted(os.listdir(path))
        if not name.endswith(_DATA_SUFFIX)
    }


def read(root: str, step: int, shard: int, into: HostSnapshot, marker: dict[str, Any]) -> int:
    """Loads a persisted snapshot into ``into``, checked against its ``marker``
    (an authentic one from :func:`scan`); returns the bytes read.

    Raises:
        SnapshotTrustError: a file of it is not ours (checked again).
        Unusable: it cannot be read, or what was read is not what was written;
            ``into`` is left incomplete.
    """
    import pickle

    import torch.distributed.checkpoint as dcp

    path = shard_dir(root, step, shard)
    try:
        _check_step(root, step_dir(root, step))
        found = _metadata_files(path)
    except OSError as ex:
        raise Unusable(f"cannot read {path}: {ex}") from None
    if found != marker["metadata"]:
        raise Unusable(
            f"{path}: its metadata files {sorted(found)} are not those it was written with "
            "(changed since, or another checkpoint's)"
        )
    # the skeleton is unpickled only now: its marker is authentic, every file ours
    skeleton = {k: base64.b64decode(v) for k, v in marker["skeleton"].items()}
    refs = [r for v in skeleton.values() for r in layout.refs(pickle.loads(v)[1])]
    into.assign(step, shard, skeleton, refs)
    try:
        views = into.views()
        template = {k: layout.fill(kv[1], views) for k, kv in into.unpickled().items()}
        dcp.load(template, checkpoint_id=path, no_dist=True)
    except _dcp_errors() as ex:  # a damaged file: DCP's own errors, a short read, unpickling
        into.invalidate()
        raise Unusable(f"cannot load {path}: {type(ex).__name__}: {ex}") from None
    # plain values come back from the checkpoint as it stored them; the skeleton has them too
    into.seal()
    expected = marker["checksums"]
    got = into.checksums()
    for key in sorted(expected):
        if got.get(key) != expected[key]:
            into.invalidate()
            raise Unusable(
                f"{path}: key {key!r} read from disk does not match its checksum "
                "(changed or damaged since it was written)"
            )
    return into.nbytes


class Persister:
    """Writes snapshots to disk in a background thread, one at a time.

    Invariant (under ``_cond``): at most one snapshot waits behind the one
    being written; a newer one replaces it (and the older is let go), so a
    disk slower than ``persist_every`` steps writes the newest due snapshot
    next, never an ever-growing queue, and training never waits for it.

    The training thread only *holds* the snapshot it hands over (a slot the
    next commits reuse), and only when the writer is free
    (:meth:`inprocess.snapshot.Snapshots.commit` checks :meth:`busy`): the
    writer's thread copies it into a private buffer of its own (kept from
    write to write: no fresh pages each time), lets go of it and then writes
    the copy. The slot is the newest complete one, so the next commit writes
    the other slot; a commit that wants this slot back while the copy still
    runs (a copy slower than two steps) is coalesced, never waits.
    """

    def __init__(self, root: str, every: int) -> None:
        self.root = root
        self.every = every
        self._cond = threading.Condition()
        #: a held snapshot waiting for the writer, with its world size, mode and lineage
        self._pending: tuple[HostSnapshot, int, bool, str | None] | None = None
        #: ``(step, lineage)`` of the last restore: no marker of a later step from
        #: another lineage is written (a trajectory the restore abandoned)
        self._fence: tuple[int, str | None] | None = None
        #: taken around a marker's write and a fence: a write's check of the fence
        #: and its marker landing are one step for :meth:`fence`
        self._marker_lock = threading.Lock()
        #: the writer's private copy of what it writes (its thread's alone)
        self._copy = HostSnapshot()
        self._writing = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self.skipped = 0
        self.last_error: BaseException | None = None
        self.written: list[int] = []

    def due(self, step: int) -> bool:
        """Whether ``step``'s snapshot goes to disk: every ``persist_every`` steps, and
        the next one after a request (SIGUSR1: the job ends soon)."""
        if persist_signal.take():
            log.warning("persisting the snapshot of step %d: asked by SIGUSR1", step)
            return True
        return step % self.every == 0

    def busy(self) -> bool:
        """Whether a snapshot is being copied or written, or waits to be (never waits)."""
        with self._cond:
            return self._writing or self._pending is not None

    def submit(
        self,
        snapshot: HostSnapshot,
        world_size: int,
        replicated: bool,
        lineage: str | None = None,
    ) -> None:
        """Queues the complete, landed ``snapshot`` (of ``lineage``: see the module's
        doc) for writing, replacing one still waiting; it is held until the
        writer has copied it. Never waits."""
        snapshot.hold()
        with self._cond:
            if self._pending is not None:
                self.skipped += 1
                log.info(
                    "snapshot of step %s not persisted: the disk is behind (newer one queued)",
                    self._pending[0].step,
                )
                self._pending[0].unhold()
            self._pending = (snapshot, world_size, replicated, lineage)
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
            source, world_size, replicated, lineage = job
            step = source.step  # (held: nothing changes it until unhold)
            try:
                try:
                    self._copy.copy_from(source)
                finally:
                    source.unhold()  # the training thread may reuse the slot from here
                self._write(self._copy, world_size, replicated, lineage)
            except Exception as ex:  # (the copy: out of memory) never the thread's end
                self.last_error = ex
                log.warning("persisting the snapshot of step %s failed: %r", step, ex)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def withdraw(self, snapshot: HostSnapshot) -> bool:
        """Takes back ``snapshot`` if it still waits for the writer (not copied yet),
        and lets go of it: a newer due snapshot is about to take its place (as a
        newer one replaces one waiting, :meth:`submit`). Never waits."""
        # Invariant: a snapshot handed over is let go of exactly once: by the writer
        # once it copied it, or, while it still waits (under _cond), by whoever
        # takes it out of _pending (submit, withdraw, close).
        with self._cond:
            if self._pending is None or self._pending[0] is not snapshot:
                return False
            self._pending = None
            self.skipped += 1
            log.info(
                "snapshot of step %s not persisted: a newer due one takes its place", snapshot.step
            )
        snapshot.unhold()
        return True

    def fence(self, step: int, lineage: str | None) -> None:
        """From now on no marker is written for a step after ``step`` unless it is of
        ``lineage`` (the one the restore to ``step`` started): a write still in
        flight from before the restore ends without its marker."""
        with self._marker_lock:
            self._fence = (step, lineage)

    def _fenced(self, step: int, lineage: str | None) -> bool:
        return self._fence is not None and step > self._fence[0] and lineage != self._fence[1]

    def _write(
        self, snap: HostSnapshot, world_size: int, replicated: bool, lineage: str | None = None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        step, shard = snap.step, snap.shard
        assert step is not None
        try:
            started = time.monotonic()
            views = snap.views()
            state = {k: layout.fill(kv[1], views) for k, kv in snap.unpickled().items()}
            path = shard_dir(self.root, step, shard)
            # Invariant: written only into a snapshot_dir of ours that nobody else can
            # write to, and every directory and file private to this user (so the
            # checks of a restore pass whatever the umask).
            prepare(self.root)
            if os.path.exists(marker_path(self.root, step, shard)):
                os.unlink(marker_path(self.root, step, shard))  # rewritten: incomplete meanwhile
            for directory in (step_dir(self.root, step), path):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(directory, 0o700)
            dcp.save(state, checkpoint_id=path, no_dist=True)
            _private_files(path)
            _fsync_tree(path)
            marker = {
                "step": step,
                "shard": shard,
                "world_size": world_size,
                "replicated": replicated,
                "lineage": lineage,
                "bytes": snap.nbytes,
                "time": time.time(),
                "checksums": snap.checksums(),
                "skeleton": {k: base64.b64encode(v).decode() for k, v in snap.skeleton.items()},
                "metadata": _metadata_files(path),
            }
            signed = _sign(marker, marker_key(self.root, create=True))  # type: ignore[arg-type]
            # Invariant: a marker lands only while no fence excludes it (checked and
            # written under _marker_lock, which fence() takes): once a restore
            # fenced a step, no marker of its abandoned trajectory appears.
            with self._marker_lock:
                if self._fenced(step, lineage):
                    log.info("step %d not persisted: a restore went back before it", step)
                    return
                _atomic_json(marker_path(self.root, step, shard), signed)
            self.written.append(step)
            log.debug(
                "persisted step %d shard %d in %.3fs", step, shard, time.monotonic() - started
            )
            # Every writer prunes after its write: the last shard of a step to land
            # sees the step whole (concurrent prunes remove the same directories).
            self._prune(1 if replicated else world_size, step)
        # Invariant: an error of a write is reported and ends that write only, never
        # the thread (flush and close would wait for it for good)
        except (*_dcp_errors(), SnapshotTrustError) as ex:
            self.last_error = ex
            log.warning("persisting the snapshot of step %s failed: %r", step, ex)

    def _prune(self, shards: int, written: int) -> None:
        """Keeps the ``KEEP`` newest whole steps (every shard complete, of one
        lineage, laid out as the one just ``written``) up to that step, and what
        is newer.

        Older steps go, incomplete ones too: a step older than a whole one is
        never written any more (each rank writes its steps in order), and one
        left incomplete (a rank's write skipped while its disk was behind) can
        never be restored. Steps newer than the one written are left out of
        the count: a future the restore went back from (a step that failed its
        checks), rewritten when training gets there again. A step with a
        marker of another layout (committed at another world size, or in the
        other mode) is never removed: a world of that size may restore it.
        """
        done: dict[int, set[int]] = {}
        lineages: dict[int, set[str | None]] = {}
        foreign: set[int] = set()
        for (shard, step), marker in scan(self.root).complete.items():
            if layout_of(marker) != shards:
                foreign.add(step)
            elif step <= written:
                done.setdefault(step, set()).add(shard)
                lineages.setdefault(step, set()).add(marker.get("lineage"))
        whole = sorted(
            s
            for s, have in done.items()
            if len(have) >= shards and len(lineages[s]) == 1 and s not in foreign
        )
        if not whole:
            return
        keep = set(whole[-KEEP:])
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            old = m is not None and int(m.group(1)) < whole[-1]
            if old and int(m.group(1)) not in keep | foreign:  # type: ignore[union-attr]
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
                self._pending[0].unhold()
                self._pending = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still writing: its private copy is its own until it ends
            self._thread = None
        self._copy.release()


def _atomic_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a torn write's leftover
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _private_files(path: str) -> None:
    """Takes write permission from group and others on the files DCP wrote (its umask)."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        info = os.lstat(full)
        if stat.S_ISREG(info.st_mode) and info.st_mode & 0o022:
            os.chmod(full, stat.S_IMODE(info.st_mode) & ~0o022)


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


__all__ = [
    "Persister",
    "Scan",
    "SnapshotCorrupt",
    "SnapshotTrustError",
    "Unusable",
    "complete",
    "fence",
    "layout_of",
    "prepare",
    "read",
    "scan",
]
