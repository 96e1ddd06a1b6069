"""What happened: restart records of the Wrapper, and JSON-lines files to keep them.

Two writers share one format, JSON lines (one object per line, a ``"type"``
field saying what it is):

* the Wrapper writes ``restart`` records (one per restart, by the rank that is
  rank 0 of the new iteration, just before it calls the function again),
  ``join`` records (one per admitted late process, by that process: the times
  of its start, its monitor process, its join request and its admission),
  ``iteration`` records (every rank, when its function starts and when its
  iteration ends), ``restore`` records (one per
  :meth:`inprocess.CallWrapper.restore`, by the iteration's active rank 0) and
  a ``completed`` record, to the file named by
  ``Wrapper(records=...)`` or, when that is ``None``, by the environment
  variable :data:`RECORDS_ENV` (``inprocess-run`` sets it to
  ``<state_dir>/restarts.jsonl``);
* the job controller writes ``event`` records to ``<state_dir>/events.jsonl``
  (:mod:`inprocess.failover.controller`).

A restart record merges what every rank saw: the faulting ranks and their
causes come from the call's fault log in the store (each observer records the
fault it saw, see :mod:`inprocess.protocol`), and each survivor appends the
durations of its restart phases to the ended iteration's ``phases`` key before
it meets the others at the iteration barrier; the writer reads them once it
has passed that barrier (so every survivor's entry is there) and reports, per
phase, the longest of any rank: the phase that held the job up.

Writing is one ``write(2)`` of a whole line to a file opened with ``O_APPEND``:
lines of concurrent writers (the ranks of a machine) never interleave, and a
writer killed mid-line leaves at most one torn line, which readers skip
(:func:`read_jsonl`). Records cost a few store operations and file appends per
restart and nothing while the function runs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from . import protocol
from .ownership import distrust, distrust_chain
from .protocol import initial_rank_of

log = logging.getLogger(__name__)

#: environment variable naming the records file when ``Wrapper(records=None)``
RECORDS_ENV = "INPROCESS_RECORDS"
#: file names in an ``inprocess-run`` state directory
RESTARTS_FILE = "restarts.jsonl"
EVENTS_FILE = "events.jsonl"

#: causes of a fault in a restart record
CAUSES = ("exception", "signal", "hang", "heartbeat", "unhealthy", "terminated", "connection")
#: the phases of a restart, in order
PHASES = (
    "detect",
    "abort",
    "finalize",
    "health_check",
    "termination_barrier",
    "rank_assignment",
    "back_in_function",
)
#: events of the job controller's events file
EVENTS = (
    "job_start",
    "worker_exit",
    "worker_relaunch",
    "node_relaunch",
    "cold_restart",
    "controller_recovery",
    "limit",
    "job_end",
    "state_save_failed",  # the controller could not save the job's state (detail: path, errno)
)
#: the fields of a controller event (those that do not apply are ``None``)
EVENT_FIELDS = (
    "generation",
    "node",
    "slot",
    "local_rank",
    "rank",
    "pid",
    "returncode",
    "signal",
    "detail",
    "world_size",
    "target",
    "expected",  # worker_exit: the controller stopped it on purpose (not a failure)
)

_JOIN_REQUEST = "join request"


# --------------------------------------------------------------------------- files


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, in order; a torn or unreadable line is skipped.

    A missing file reads as no records.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    records = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # torn by a writer that died mid-line, or nested too deeply
        if isinstance(record, dict):
            records.append(record)
    return records


#: directories whose chain :func:`distrust_chain` found trusted, in this process: it
#: stays so (only this user and root can change it), so it is looked at once
_trusted_dirs: set[str] = set()


def records_distrust(path: str | os.PathLike[str]) -> str | None:
    """Why the records file ``path`` is not this user's own to append to; ``None``: it is.

    A records file is written by the job's processes for as long as they run, and
    by root as often as by anyone: one another user planted (in ``/tmp``...), or
    could swap through a directory they control, would have the job write into a
    file of their choosing. So the file, when it exists, must be this user's and no
    symlink, and its directory's chain only this user's and root's
    (:func:`inprocess.ownership.distrust_chain`).
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    if directory not in _trusted_dirs:
        why = distrust_chain(directory)
        if why is not None:
            return why
        if os.path.isdir(directory):  # (one still to be made is looked at again)
            _trusted_dirs.add(directory)
    try:
        why = distrust(os.lstat(path), others=0)
    except FileNotFoundError:
        return None
    return None if why is None else f"{path} {why}"


def append_jsonl(
    path: str | os.PathLike[str],
    record: dict[str, Any],
    durable: bool = False,
    nofollow: bool = False,
    owned: bool = False,
) -> None:
    """Appends ``record`` as one line, in one ``write(2)`` (``O_APPEND``: concurrent
    writers' lines never interleave). ``durable`` also fsyncs it; ``nofollow``
    refuses a symlink at ``path`` (ELOOP) instead of writing through it;
    ``owned`` (implies ``nofollow``) refuses, with a ``PermissionError`` saying
    why, a file that is not this user's own (:func:`records_distrust`): the
    file opened is looked at, not only its name."""
    line = json.dumps(record, separators=(",", ":"), default=str).encode() + b"\n"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    if owned:
        why = records_distrust(path)  # before the file is made in a stranger's place
        if why is not None:
            raise PermissionError(why)
    fd = os.open(path, flags | (os.O_NOFOLLOW if nofollow or owned else 0), 0o600)
    try:
        if owned:
            # What was opened, whatever was at the path when it was looked at; and
            # its directory again, should someone have made it meanwhile.
            why = distrust(os.fstat(fd), others=0)
            why = f"{os.fspath(path)} {why}" if why is not None else records_distrust(path)
            if why is not None:
                raise PermissionError(why)
        os.write(fd, line)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def end_torn_line(path: str | os.PathLike[str]) -> None:
    """Ends a torn last line (a writer died mid-line) so the next line starts clean.
    Never through a symlink."""
    with contextlib.suppress(OSError), open(
        path, "rb+", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)
    ) as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


#: control characters (C0, DEL, C1) as the ``\\xNN`` escapes that show them
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES_KEEP_LINES = {c: e for c, e in _ESCAPES.items() if chr(c) not in "\n\t"}


def printable(text: str, lines: bool = False) -> str:
    """``text`` (from a worker: an exception's message...) safe to print on a terminal:
    its control characters escaped (``\\x1b``), so that no escape sequence it holds
    moves the cursor, retitles the window or hides what was printed. ``lines``:
    newlines and tabs are kept."""
    return text.translate(_ESCAPES_KEEP_LINES if lines else _ESCAPES)


def records_path(argument: str | os.PathLike[str] | None) -> str | None:
    """Where the Wrapper writes records: the argument, else :data:`RECORDS_ENV`, else nowhere."""
    if argument is not None:
        return os.fspath(argument)
    return os.environ.get(RECORDS_ENV) or None


def event(name: str, time_: float | None = None, **fields: Any) -> dict[str, Any]:
    """A controller event record: every field of :data:`EVENT_FIELDS`, ``None`` unless given."""
    if name not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}, got {name!r}")
    unknown = set(fields) - set(EVENT_FIELDS)
    if unknown:
        raise ValueError(f"unknown event fields {sorted(unknown)}; allowed: {EVENT_FIELDS}")
    record: dict[str, Any] = {
        "type": "event",
        "time": time.time() if time_ is None else time_,
        "event": name,
    }
    record.update({f: fields.get(f) for f in EVENT_FIELDS})
    return record


# --------------------------------------------------------------------------- causes


def classify(reason: str) -> str:
    """The cause (one of :data:`CAUSES`) of a fault log reason."""
    text = reason.removeprefix(protocol.TERMINATED_PREFIX)
    if protocol.derived(text):
        # a collective broken by a peer that went away: its death is recorded
        # (by the peer's monitor process) in this restart or the next one
        return "connection"
    if text.startswith("no heartbeat"):
        return "heartbeat"
    if "timeout" in text:  # soft timeout, hard timeout, completion timeout
        return "hang"
    if text.startswith(("process died", "its process ")):
        # its monitor process's report of the death, or the job controller's
        # ("its process was killed by SIGKILL (seen by the job controller)"):
        # the first to arrive stands, so both must read alike
        return "signal"
    if text.startswith("health check") or "unhealthy" in text:
        return "unhealthy"
    if reason.startswith(protocol.TERMINATED_PREFIX):
        return "terminated"
    return "exception"


def faults_of(
    entries: Sequence[dict[str, Any]], members: Sequence[str]
) -> tuple[list[dict[str, Any]], list[int], float | None]:
    """The faults of one restart from its fault log entries: ``(faults, joined, fault_time)``.

    One fault per rank (its first entry), the root cause first (see
    :func:`inprocess.protocol.root_cause`), and the rank's death when it came
    after a fault of its own (it raised, then was ended stuck in native code
    while releasing what the fault left: two incidents); errors derived from a
    peer's fault only when nothing else was recorded. ``joined``: initial ranks that asked to
    join. ``fault_time``: when the root cause was recorded (``None``: no fault).
    """
    joined = sorted(
        {initial_rank_of(str(e["rank"])) for e in entries if e.get("reason") == _JOIN_REQUEST}
    )
    real = [e for e in entries if e.get("reason") != _JOIN_REQUEST]
    primary = [e for e in real if not protocol.derived(str(e.get("reason", "")))]
    if not primary and not joined:
        primary = real
    # With a join request and nothing but derived errors, the restart is the one
    # that admits the joiner: the survivors' collectives broke because it was
    # interrupted, not because of a fault.
    faults: list[dict[str, Any]] = []
    seen: set[tuple[str, bool]] = set()
    for entry in primary:
        identity, reason = str(entry["rank"]), str(entry["reason"])
        died = reason.startswith(protocol.TERMINATED_PREFIX)
        if (identity, died) in seen or (identity, True) in seen:
            continue
        seen.add((identity, died))
        faults.append(
            {
                "rank": members.index(identity) if identity in members else None,
                "initial_rank": initial_rank_of(identity),
                "cause": classify(reason),
                "detail": reason.removeprefix(protocol.TERMINATED_PREFIX)[:300],
                "time": entry.get("time"),
            }
        )
    fault_time = primary[0].get("time") if primary else None
    return faults, joined, fault_time


# --------------------------------------------------------------------------- the Wrapper's side


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """Records never break a restart: a failure of ours is logged once and turns them off.

    (``function_starting`` runs in the interruptible region, where an exception
    would read as a fault of the iteration; ``RankShouldRestart``, a
    ``BaseException``, passes through.)
    """

    @functools.wraps(method)
    def guarded(self: Recorder, *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            method(self, *args, **kwargs)
        except Exception as ex:
            self.enabled = False
            log.warning("%s: restart records off after an error: %r", self.identity, ex)

    return guarded


class Recorder:
    """The records of one call of a wrapped function on one rank.

    Built disabled (every method returns at once) when no records file is set.
    Used by the call's thread only; the phase it times run outside the
    function, except :meth:`function_starting`, which runs in the interruptible
    region: an interruption there costs at most the record being written.
    """

    def __init__(self, path: str | None, identity: str, namespace: str, call: int) -> None:
        self.path = path
        self.enabled = path is not None
        self.identity = identity
        self.call = call
        # Ranks of one job (generation, restart attempt) share their namespace:
        # a short digest of it tells jobs apart without writing the key space out.
        self.job = hashlib.sha1(namespace.encode()).hexdigest()[:10]
        self.initial_rank = initial_rank_of(identity)
        self._common = {
            "job": self.job,
            "call": call,
            "initial_rank": self.initial_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": _int_env("GROUP_RANK"),
        }
        self._phases: dict[str, float] = {}
        self._detected: float | None = None
        #: the iteration that ended in a fault, until the next one starts
        self._ended: Any = None
        self._ended_active: set[str] = set()
        self._terminated: list[str] = []
        self._published = False  # this rank's phases (and so the phases key) are in the store

    # ------------------------------------------------------------ writing

    def _write(self, record: dict[str, Any]) -> None:
        assert self.path is not None
        try:
            # never through a symlink, nor to a file or through a directory of another
            # user: one planted at the records file's path would have the job append
            # to whatever file it names
            append_jsonl(self.path, record, owned=True)
        except OSError as ex:
            self.enabled = False  # one warning, not one per iteration
            why = "it is a symlink" if ex.errno == errno.ELOOP else ex
            log.warning(
                "%s: cannot write the restart records to %s: %s", self.identity, self.path, why
            )

    # ------------------------------------------------------------ per iteration

    @_never_raises
    def function_starting(self, store: Any, current: Any, state: Any) -> None:
        """The function (or a spare's wait) starts: an ``iteration`` start record,
        and on rank 0 the ``restart`` record of the restart that led here."""
        if not self.enabled:
            return
        now = time.time()
        active = state.mode.value == "active"
        if self._ended is not None:
            if "rank_assignment" in self._phases:
                self._phases["back_in_function"] = time.monotonic() - self._phase_end
            if state.rank == 0:
                self._write_restart(store, current, state, now)
            self._ended = None
        self._write(
            {
                "type": "iteration",
                "time": now,
                "state": "start",
                "iteration": current.index,
                "rank": state.rank,
                "world_size": state.world_size,
                "active": active,
                **self._common,
            }
        )

    @_never_raises
    def iteration_ended(self, current: Any, completed: bool, state: Any) -> None:
        """The iteration ended on this rank (``completed``, or a fault: the restart starts)."""
        if not self.enabled:
            return
        now = time.time()
        self._write(
            {
                "type": "iteration",
                "time": now,
                "state": "end",
                "iteration": current.index,
                "outcome": protocol.COMPLETED if completed else protocol.FAULT,
                "rank": state.rank,
                **self._common,
            }
        )
        if completed:
            return
        self._detected = now
        self._phases = {}
        self._phase_end = time.monotonic()
        self._ended = current
        active = state.active_world_size if isinstance(state.active_world_size, int) else 0
        self._ended_active = set(current.members[:active])

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times one phase of the restart (it ends where the next one starts)."""
        if not self.enabled or self._ended is None:
            yield
            return
        try:
            yield
        finally:
            end = time.monotonic()
            self._phases[name] = end - self._phase_end
            self._phase_end = end

    @_never_raises
    def publish_phases(self, store: Any, terminated: Iterable[str]) -> None:
        """After the termination barrier: this rank's phases, for the writer to merge."""
        if not self.enabled or self._ended is None:
            return
        self._terminated = sorted(terminated)
        entry = {"rank": self.identity, "detected": self._detected, **self._phases}
        self._published = False
        try:
            store.add_entry(
                protocol.iteration_key(self._ended.index, protocol.PHASES), json.dumps(entry)
            )
            self._published = True
        except Exception as ex:  # records never stop a restart
            log.debug("%s: cannot publish restart phases: %s", self.identity, ex)

    def _write_restart(self, store: Any, current: Any, state: Any, now: float) -> None:
        ended = self._ended
        # One round trip to the store (this is on the way back into the function) when
        # both keys surely exist: this rank published its phases, and an earlier fault
        # of the call (baseline > 0) created the fault log. (A multi_get of a missing
        # key would block for the store's timeout.) Else two.
        keys = [protocol.FAULT_LOG, protocol.iteration_key(ended.index, protocol.PHASES)]
        try:
            if (self._published and ended.baseline > 0) or store.check(keys):
                log_text, phases_text = (v.decode(errors="replace") for v in store.multi_get(keys))
            else:
                log_text, phases_text = store.get_or(keys[0]), store.get_or(keys[1])
            # Authentic records only (a stranger's appends are skipped, see security.seal).
            log_text = "\n".join(store.decode_entries(keys[0], log_text))
            phases_text = "\n".join(store.decode_entries(keys[1], phases_text))
            entries = protocol.parse_fault_log(log_text)[ended.baseline :]
        except Exception as ex:
            log.debug("%s: cannot read the restart's faults: %s", self.identity, ex)
            entries, phases_text = [], ""
        faults, joined, fault_time = faults_of(entries, ended.members)
        per_rank = protocol.parse_phases(phases_text)
        per_rank.setdefault(self.identity, {"detected": self._detected, **self._phases})
        start = fault_time if fault_time is not None else self._detected
        phases: dict[str, float] = {}
        detected = [p["detected"] for p in per_rank.values() if p.get("detected") is not None]
        if detected and start is not None:
            phases["detect"] = max(0.0, max(detected) - start)
        for name in PHASES[1:5]:
            values = [float(p[name]) for p in per_rank.values() if p.get(name) is not None]
            if values:
                phases[name] = max(values)
        for name in PHASES[5:]:
            if name in self._phases:
                phases[name] = self._phases[name]
        active = state.active_world_size if isinstance(state.active_world_size, int) else 0
        activated = set(current.members[:active]) - self._ended_active
        self._write(
            {
                "type": "restart",
                "time": start,
                "iteration": ended.index,
                "world_size": len(current.members),
                "active_world_size": active,
                "previous_world_size": len(ended.members),
                "faults": [{k: v for k, v in f.items() if k != "time"} for f in faults],
                "terminated": sorted(initial_rank_of(i) for i in self._terminated),
                "activated": sorted(initial_rank_of(i) for i in activated),
                "joined": joined,
                "phases": {k: round(v, 6) for k, v in phases.items()},
                "latency": None if start is None else round(now - start, 6),
                "back_at": now,
                "job": self.job,
                "call": self.call,
                "node": self._common["node"],
            }
        )

    @_never_raises
    def joined(self, iteration: int, timeline: dict[str, float | None], monitor: str) -> None:
        """A ``join`` record: a process that came late (a relaunched worker, a standby
        that took over) was admitted at the restart that ended ``iteration``.

        ``timeline``: ``time.time()`` of ``process_start`` (the process's creation: a
        standby's is when it was made, before it took over), ``call_start`` (the
        Wrapper call began), ``monitor_ready`` (its monitor process reported ready;
        ``None``: not yet, a fresh interpreter still starting beside the rank),
        ``join_request`` and ``admitted``; ``monitor``: ``"forked"`` or
        ``"spawned"``. With the controller's ``worker_exit`` and
        ``worker_relaunch`` events and the ``restart`` record that admitted it,
        this places every second between a worker's loss and its replacement
        training.
        """
        if not self.enabled:
            return
        self._write(
            {
                "type": "join",
                "time": time.time(),
                "iteration": iteration,
                **timeline,
                "monitor": monitor,
                **self._common,
            }
        )

    @_never_raises
    def restore(self, record: dict[str, Any]) -> None:
        """A ``restore`` record (:meth:`inprocess.CallWrapper.restore`), by the active rank 0."""
        self._write({**record, "job": self.job, "call": self.call})

    @_never_raises
    def completed(self, current: Any, state: Any) -> None:
        """The call completed: rank 0 writes a ``completed`` record."""
        if self.enabled and state.rank == 0:
            self._write(
                {
                    "type": "completed",
                    "time": time.time(),
                    "iteration": current.index,
                    "world_size": len(current.members),
                    "job": self.job,
                    "call": self.call,
                }
            )


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
