"""Processes of this machine: identity by pid and start time.

A pid alone names a process only while it lives: the kernel reuses it. The
pair (pid, start time) names one process for good. Used by the local backend
for the workers, and by the controller for the job's store server, which runs
on the controller's machine whatever the backend.
"""

from __future__ import annotations

from ..procfs import process_start_time

__all__ = ["process_start_time"]
