"""Ending a process at once, without the interpreter's teardown."""

from __future__ import annotations

import contextlib
import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flushes the logs and stdio, then ends the process without the
    interpreter's teardown (no garbage collection, no native destructors).

    For a process whose work is done and saved (with torch loaded, the teardown
    is a garbage collection over every object, seconds on a busy machine), and
    for one whose CUDA context is broken (native destructors that touch CUDA
    would abort it: :mod:`inprocess.device_fault`).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
