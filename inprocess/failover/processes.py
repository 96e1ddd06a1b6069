"""Processes of this machine: identity by pid and start time.

A pid alone names a process only while it lives: the kernel reuses it. The
pair (pid, start time) names one process for good. Used by the local backend
for the workers, and by the controller for the job's store server, which runs
on the controller's machine whatever the backend.
"""

from __future__ import annotations


def process_start_time(pid: int) -> float | None:
    """Start time of ``pid`` in clock ticks since boot, or ``None`` if it does not exist.

    Together with the pid it identifies a process: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return float(fields[19])
