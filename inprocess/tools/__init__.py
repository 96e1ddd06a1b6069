"""Tools for exercising fault tolerance: fault injection, local multi-rank jobs."""

from . import inject_fault

__all__ = ["inject_fault"]  # local_job: imported by name, it needs psutil and the launcher
