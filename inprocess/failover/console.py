"""What ``inprocess-run`` shows on its console while a job runs.

* Per-worker log files (``--log-dir``, ``--redirects``, ``--tee``), laid out
  as torchrun lays them out: ``<log-dir>/<job-id>_<random>/attempt_<generation>/
  <rank>/stdout.log`` and ``stderr.log`` (``<rank>``: the global rank, which is
  the local rank on one node). :func:`worker_output` says where a worker's
  streams go; the controller passes that to the backend's one spawn function.
* :class:`LogTailer`: copies the tee'd files to the console, each line prefixed
  with ``[default<rank>]:`` as torchrun does. It runs in the ``inprocess-run``
  process (the supervisor), which outlives any controller crash; the workers
  write to files, so nothing they write depends on a reader being alive.
* :class:`StatusLine`: one live line at the bottom of a terminal (generation,
  world size / target, workers alive, restarts, the last fault and its
  latency). The rows above it are the terminal's scroll region (DECSTBM):
  everything else written to the terminal, by any process of the job, scrolls
  there and never lands on the status line, so nothing needs to be routed
  through us. Without a terminal, new restarts are logged as plain lines.
* :class:`Console`: the thread that runs both, started and stopped by the CLI.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from ..ownership import distrust, distrust_chain
from ..records import printable
from .spec import JobSpec
from .state import StateError, StateStore, WorkerStatus

log = logging.getLogger(__name__)

#: seconds between two looks at the log files and the job's records
TICK = 0.1
#: seconds between two redraws of the status line (at most)
STATUS_PERIOD = 0.25
#: longest piece of a tee'd line shown as one console line (bytes); what a worker
#: prints without a newline is held back up to this much, then shown
MAX_LINE = 64 * 1024
_STREAMS = (("stdout", 1), ("stderr", 2))


def worker_log_dir(spec: JobSpec, generation: int, worker: int) -> Path:
    """``<log_dir>/attempt_<generation>/<rank>`` (``spec.log_dir`` must be set)."""
    assert spec.log_dir is not None
    return Path(spec.log_dir) / f"attempt_{generation}" / str(worker)


#: mode of the log directories the job makes (nobody else may write in them)
LOG_DIR_MODE = 0o750
#: mode of the log files the job makes
LOG_FILE_MODE = 0o640


def make_log_dirs(spec: JobSpec, generation: int, worker: int) -> Path:
    """Creates (``LOG_DIR_MODE``) or checks ``worker``'s log directory and those
    between it and ``spec.log_dir``; returns it.

    The directories above the log dir must be ones only this user or root may
    change (:func:`~inprocess.ownership.distrust_chain`, also checked at the
    launch): another user who could rename what is in them could swap a
    directory of ours for one of theirs at any time, and what the worker itself
    writes there (torch's ``error.json``) is opened by its path, following
    symlinks, with no check of ours. Every level below is checked with ``lstat``
    (never followed) to be a directory of this user that nobody else can write.

    Raises:
        PermissionError: naming the directory that is not ours, and why.
    """
    assert spec.log_dir is not None
    directory = Path(spec.log_dir)
    why = distrust_chain(directory.parent)
    if why is not None:
        raise PermissionError(f"log directory {directory}: {why}")
    for part in (None, f"attempt_{generation}", str(worker)):
        if part is not None:
            directory = directory / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, LOG_DIR_MODE)
        why = distrust(os.lstat(directory), directory=True)
        if why is not None:
            raise PermissionError(f"log directory {directory} {why}")
    return directory


def open_log(path: str) -> int:
    """``path`` opened for appending (created ``LOG_FILE_MODE``); a symlink is refused
    (``O_NOFOLLOW``: never another file written through it), and the descriptor
    is not inherited by anything else the job starts (``O_CLOEXEC``); nor is a file
    of another user (one planted after :func:`make_log_dirs` looked): the
    worker's output is never handed to a stranger.

    Raises:
        OSError: the file cannot be opened, or is not ours (``PermissionError``).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, LOG_FILE_MODE)
    why = distrust(os.fstat(fd), others=0)  # (its mode is ours to set: LOG_FILE_MODE)
    if why is not None:
        os.close(fd)
        raise PermissionError(f"log file {path} {why}")
    return fd


def worker_output(
    spec: JobSpec, worker: int, generation: int
) -> tuple[str | None, str | None, dict[str, str]]:
    """Where ``worker``'s stdout and stderr go, and the variables that go with it.

    A stream is written to its log file when redirected or tee'd; else, to the
    console (``None``: inherited) when its local rank passes
    ``--local-ranks-filter``, or nowhere (``os.devnull``). With a log dir, the
    worker's directory is created and the worker gets
    ``TORCHELASTIC_ERROR_FILE`` (torchrun's ``error.json``);
    a Python worker writing to a file gets ``PYTHONUNBUFFERED=1`` (unless set),
    so that what it printed is in the file when it dies and tee'd lines show
    at once. A log directory that is not ours (:func:`make_log_dirs`) is not
    written: the worker's streams go to the console then, and the refusal is
    logged.
    """
    redirect, tee, shown = spec.streams_of(worker)
    log_dir = spec.log_dir
    env: dict[str, str] = {}
    if log_dir is not None:
        try:
            directory = make_log_dirs(spec, generation, worker)  # also for error.json alone
        except OSError as ex:
            log.error("worker %d's output is not written to its log files: %s", worker, ex)
            log_dir = None
        else:
            env["TORCHELASTIC_ERROR_FILE"] = str(directory / "error.json")
    paths: list[str | None] = []
    for name, bit in _STREAMS:
        if log_dir is not None and (redirect | tee) & bit:
            paths.append(str(worker_log_dir(spec, generation, worker) / f"{name}.log"))
        elif log_dir is None and spec.log_dir is not None and (redirect | tee) & bit:
            paths.append(None)  # (refused above) to the console rather than lost
        else:
            paths.append(None if shown else os.devnull)
    if any(p not in (None, os.devnull) for p in paths) and "PYTHONUNBUFFERED" not in os.environ:
        env["PYTHONUNBUFFERED"] = "1"
    return paths[0], paths[1], env


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except InterruptedError:
            continue
        except OSError:  # the console is gone (a closed pipe): nothing to show it on
            return


class LogTailer:
    """Copies the tee'd log files of a job to the console, line by line, prefixed.

    Only streams tee'd (``--tee``) of local ranks that pass
    ``--local-ranks-filter`` are copied; stdout files to our stdout, stderr
    files to our stderr. Called from one thread only.
    """

    _ATTEMPT = re.compile(r"attempt_(\d+)")

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._tailed: list[tuple[int, str, int]] = []  # (worker, stream, console fd)
        if spec.log_dir is not None:
            for worker in range(spec.world_size):
                _, tee, shown = spec.streams_of(worker)
                for name, bit in _STREAMS:
                    if shown and tee & bit:
                        self._tailed.append((worker, name, bit))

    def poll(self, final: bool = False) -> None:
        """Copies what was appended since the last call (``final``: partial lines too)."""
        if not self._tailed:
            return
        assert self.spec.log_dir is not None
        try:
            attempts = sorted(
                (int(m.group(1)), entry.path)
                for entry in os.scandir(self.spec.log_dir)
                if (m := self._ATTEMPT.fullmatch(entry.name))
            )
        except OSError:
            return
        for _, attempt in attempts:
            for worker, name, fd in self._tailed:
                self._copy(Path(attempt) / str(worker) / f"{name}.log", worker, fd, final)

    def _copy(self, path: Path, worker: int, fd: int, final: bool) -> None:
        offset = self._offsets.get(path, 0)
        try:
            # (never through a symlink planted in place of a log file, nor another
            # user's file: what a stranger wrote is not shown as a worker's)
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                if os.fstat(f.fileno()).st_uid != os.getuid():
                    return
                f.seek(offset)
                data = f.read(1 << 20)
        except OSError:
            return
        if not data and not (final and self._partial.get(path)):
            return
        self._offsets[path] = offset + len(data)
        # Invariant: what is held back of a line is shorter than MAX_LINE, so each
        # poll copies at most MAX_LINE + one read, whatever a worker prints without
        # a newline (a progress bar): a longer line is shown in MAX_LINE pieces.
        data = self._partial.pop(path, b"") + data
        lines = data.split(b"\n")
        rest = lines.pop()
        held = 0 if final else len(rest) % MAX_LINE
        pieces = [piece for line in lines for piece in _pieces(line)]
        if len(rest) > held:
            pieces += _pieces(rest[: len(rest) - held])
        if held:
            self._partial[path] = rest[len(rest) - held :]
        if pieces:
            prefix = f"[default{worker}]:".encode()
            _write_all(fd, b"".join(prefix + piece + b"\n" for piece in pieces))


def _pieces(line: bytes) -> list[bytes]:
    """``line`` cut into pieces of at most :data:`MAX_LINE` bytes (an empty line: one)."""
    return [line[i : i + MAX_LINE] for i in range(0, max(len(line), 1), MAX_LINE)]


class JobView:
    """What the status line shows, read from the job's state dir.

    ``state.json`` (the controller's state, replaced atomically), and the
    records appended by the job: ``restarts.jsonl`` (one line per in-process
    restart of the Wrapper) and ``events.jsonl`` (the controller's events).
    Appended files are read incrementally; a torn last line is left for later.
    """

    def __init__(self, state_dir: Path) -> None:
        self.states = StateStore(state_dir)
        self.state_dir = state_dir
        #: (inode, mtime, size) of the state file last parsed
        self._state_seen: tuple[int, int, int] | None = None
        self.started = time.monotonic()
        self.state: Any = None
        #: why the controller could not save the job's state, once it said so
        self.state_unsaved = ""
        self.restarts = 0
        self.relaunches = 0
        #: (time, text, latency or None) of the last fault seen
        self.last_fault: tuple[float, str, float | None] | None = None
        #: world size of the Wrapper job after its last restart, and the generation then
        self.world: tuple[int, int] | None = None
        self.new_restarts: list[dict[str, Any]] = []
        self._offsets: dict[str, int] = {}

    def refresh(self) -> None:
        # state.json is replaced (a new inode) on every save: parse it only when it
        # was, not on every tick (the launcher is otherwise idle for hours)
        with contextlib.suppress(OSError):
            st = os.stat(self.states.path)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen != self._state_seen:
                with contextlib.suppress(StateError, ValueError):
                    self.state = self.states.load()
                    self._state_seen = seen
        for record in self._read("restarts.jsonl"):
            if record.get("type") != "restart":
                continue
            self.restarts += 1
            self.new_restarts.append(record)
            generation = self.state.generation if self.state is not None else 0
            if isinstance(record.get("world_size"), int):
                self.world = (record["world_size"], generation)
            faults = [f for f in record.get("faults") or [] if isinstance(f, dict)]
            if faults:
                text = describe_fault(faults[0])
                if len(faults) > 1:
                    text += f" (+{len(faults) - 1} more)"
                latency = record.get("latency")
                latency = float(latency) if isinstance(latency, int | float) else None
                self._fault(record.get("time"), text, latency)
        for event in self._read("events.jsonl"):
            kind = event.get("event")
            if kind == "worker_relaunch":
                self.relaunches += 1
            elif kind == "state_save_failed":
                # errno name from "...: EFBIG File too large"
                self.state_unsaved = str(event.get("detail") or "").rpartition(": ")[2][:40]
            elif kind == "worker_exit" and (event.get("returncode") or event.get("signal")):
                how = (
                    f"signal {event['signal']}"
                    if event.get("signal")
                    else f"exit code {event.get('returncode')}"
                )
                self._fault(event.get("time"), f"worker {event.get('rank')} {how}", None)

    def _fault(self, when: Any, text: str, latency: float | None) -> None:
        when = float(when) if isinstance(when, int | float) else time.time()
        if self.last_fault is None or when >= self.last_fault[0]:
            self.last_fault = (when, text, latency)

    def _read(self, name: str) -> list[dict[str, Any]]:
        """New complete JSON lines of ``name`` (bad lines skipped)."""
        offset = self._offsets.get(name, 0)
        try:
            with open(self.state_dir / name, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a torn last line waits for its end
        self._offsets[name] = offset + end
        records = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError, RecursionError):  # (too deeply nested)
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def status(self) -> str:
        """The status line's text."""
        state = self.state
        elapsed = int(time.monotonic() - self.started)
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        if state is None:
            return f"inprocess-run: starting | {clock}"
        target = state.spec.world_size
        alive = sum(r.status is WorkerStatus.RUNNING for r in state.workers.values())
        world = target
        if self.world is not None and self.world[1] == state.generation:
            world = self.world[0]
        parts = [
            f"inprocess-run {state.stage.value.lower()}",
            f"gen {state.generation}",
            f"world {world}/{target}",
            f"alive {alive}/{target}",
            f"restarts {self.restarts}",
        ]
        if self.relaunches:
            parts.append(f"relaunches {self.relaunches}")
        if state.job_restarts:
            parts.append(f"cold restarts {state.job_restarts}")
        if self.state_unsaved:
            parts.append(f"state not saved: {self.state_unsaved}")
        if self.last_fault is not None:
            _, text, latency = self.last_fault
            if latency is not None:
                text += f", recovered in {latency:.2f}s"
            parts.append(f"last fault: {text}")
        parts.append(clock)
        return " | ".join(parts)


def describe_fault(fault: dict[str, Any]) -> str:
    """``rank 2 exception: ValueError...`` from one fault of a restart record."""
    rank = fault.get("initial_rank", fault.get("rank"))
    text = f"rank {rank} {fault.get('cause') or 'fault'}"
    detail = str(fault.get("detail") or "").strip().splitlines()
    if detail:
        text += f": {detail[0][:60]}"
    return text


class StatusLine:
    """One line at the bottom of the terminal on ``fd``, rewritten in place.

    Invariants: every write is one ``write(2)`` call (a terminal serializes
    whole writes, so other processes' output never splits our escape
    sequences); the cursor is saved and restored around each draw, so output
    goes on where it was; the scroll region excludes the last row while the
    line is shown, and is reset by :meth:`close`.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.rows = 0
        self.columns = 0
        self._text = ""

    @staticmethod
    def usable(fd: int) -> bool:
        """A terminal that understands cursor movement, with a known size."""
        if not os.isatty(fd) or os.environ.get("TERM", "dumb") in ("dumb", "unknown", ""):
            return False
        try:
            return os.get_terminal_size(fd).lines >= 2
        except OSError:
            return False

    def _size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self.fd)
        except OSError:
            return self.rows, self.columns
        return size.lines, size.columns

    def _reserve(self, rows: int, columns: int) -> None:
        self.rows, self.columns = rows, columns
        # A newline first gives the bottom row away if the cursor is on it;
        # setting the region homes the cursor, so save and restore it around.
        _write_all(self.fd, f"\n\0337\033[1;{rows - 1}r\0338\033[1A".encode())

    def _release(self) -> None:
        if self.rows:
            _write_all(self.fd, f"\0337\033[r\0338\0337\033[{self.rows};1H\033[2K\0338".encode())
            self.rows = 0

    def show(self, text: str) -> None:
        text = printable(text)  # (fault texts come from workers)
        rows, columns = self._size()
        if (rows, columns) != (self.rows, self.columns):
            self._release()
            if rows < 2:
                return
            self._reserve(rows, columns)
            self._text = ""
        text = text[: max(0, self.columns - 1)]
        if text == self._text:
            return
        self._text = text
        _write_all(self.fd, f"\0337\033[{self.rows};1H\033[2K{text}\0338".encode())

    def close(self) -> None:
        """Gives the whole terminal back; the last status stays, as an ordinary line."""
        text = self._text
        self._release()
        if text:
            _write_all(self.fd, f"{text}\n".encode())


class Console:
    """The ``inprocess-run`` process's view of the job, on a thread of its own.

    ``status``: a live status line on stderr (a terminal) when True, plain log
    lines for new restarts when False, nothing when None (``--quiet``). The
    thread only reads files and writes to our console; it starts no process
    (the supervisor reaps every child of ours).
    """

    def __init__(self, state_dir: Path, spec: JobSpec, status: bool | None) -> None:
        self.view = JobView(state_dir)
        self.tailer = LogTailer(spec)
        self.status = status
        self.line = StatusLine(2) if status else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inprocess-console", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Copies the rest of the tee'd logs, shows the last status, gives the terminal back."""
        self._stop.set()
        self._thread.join()
        self.tailer.poll(final=True)
        self._update()
        if self.line is not None:
            self.line.close()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.wait(TICK):
            try:
                self.tailer.poll()
                now = time.monotonic()
                if now - last >= STATUS_PERIOD:
                    last = now
                    self._update()
            except Exception:  # the job goes on without a console view
                log.exception("the console view failed")
                return

    def _update(self) -> None:
        if self.status is None:
            return
        self.view.refresh()
        restarts, self.view.new_restarts = self.view.new_restarts, []
        if self.line is not None:
            self.line.show(self.view.status())
            return
        for record in restarts:
            faults = [f for f in record.get("faults") or [] if isinstance(f, dict)]
            latency = record.get("latency")
            text = "in-process restart at iteration {} (world size {}): {}{}".format(
                record.get("iteration"),
                record.get("world_size"),
                "; ".join(describe_fault(f) for f in faults) or "no fault named",
                f"; recovered in {latency:.2f}s" if isinstance(latency, int | float) else "",
            )
            log.info("%s", printable(text))  # a worker's text: its control characters escaped
