"""Tools for exercising fault tolerance (fault injection)."""

from . import inject_fault

__all__ = ["inject_fault"]
