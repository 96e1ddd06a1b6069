"""The one reader of ``/proc/<pid>/stat`` files: process state, start time, CPU time.

Every module that asks the kernel about a process or thread by its ``stat``
file goes through here, so the parsing lives in one place. The command name
(field 2) may hold spaces and parentheses; fields are read after its last
``)``. Index 0 of :func:`stat_fields` is therefore field 3 of proc(5), the
state.
"""

from __future__ import annotations

#: states of a stopped process (SIGSTOP, SIGTSTP, a tracer)
STOPPED_STATES = ("T", "t")


def stat_path(pid: int | str, tid: int | None = None) -> str:
    """The ``stat`` file of process ``pid`` (``"self"`` for this one), or of its thread ``tid``."""
    if tid is None:
        return f"/proc/{pid}/stat"
    return f"/proc/{pid}/task/{tid}/stat"


def read_stat(path: str) -> list[str]:
    """The fields of the ``stat`` file at ``path`` after the command name (index 0 is
    field 3, the state). Raises ``OSError`` if it cannot be read, ``IndexError`` if
    it is not a ``stat`` file."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def stat_fields(pid: int | str, tid: int | None = None) -> list[str] | None:
    """The fields of ``pid``'s (or its thread ``tid``'s) ``stat`` file after the command
    name (index 0 is field 3, the state); ``None`` if it cannot be read (gone, not ours)."""
    try:
        return read_stat(stat_path(pid, tid))
    except (OSError, IndexError):
        return None


def process_state(pid: int | str) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T``, ``Z``...); ``None`` if unreadable."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def process_stopped(pid: int | str) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer); ``False`` if unreadable."""
    return process_state(pid) in STOPPED_STATES


def process_start_time(pid: int) -> float | None:
    """Start time of ``pid`` in clock ticks since boot, or ``None`` if it does not exist
    (or is a zombie).

    Together with the pid it identifies a process: a reused pid has another start time.
    """
    fields = stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return float(fields[19])


def cpu_ticks(fields: list[str]) -> int:
    """User plus system CPU time in clock ticks, from :func:`stat_fields`'s ``fields``."""
    return int(fields[11]) + int(fields[12])


def own_area(field: int) -> tuple[int, int]:
    """Fields ``field`` and ``field + 1`` of ``/proc/self/stat``: the start and end
    addresses of one of this process's memory areas (``(0, 0)`` if unknown)."""
    try:
        fields = read_stat(stat_path("self"))
        return int(fields[field - 3]), int(fields[field - 2])
    except (OSError, IndexError, ValueError):
        return 0, 0
