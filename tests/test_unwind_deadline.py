"""The bounded unwind's judgement of a thread, on real processes' ``/proc``
entries: asleep in the kernel is stuck; computing, or waiting for a core on an
overloaded machine, is not (issue 21)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from inprocess import monitor_process
from inprocess.monitor_process import _Guardian

INTERVAL = 0.05
UNWIND = 0.5
BUSY = "while True: pass"


class _Board:
    def __init__(self, started: float) -> None:
        self.started = started

    def unwind_started(self) -> float:
        return self.started

    def phase(self) -> str:
        return "function"


def _guardian(pid: int, started: float) -> _Guardian:
    guardian = _Guardian.__new__(_Guardian)
    guardian.config = SimpleNamespace(
        interval=INTERVAL, unwind_timeout=UNWIND, parent_pid=pid, identity="r0"
    )
    guardian.board = _Board(started)
    guardian.task_dir = f"/proc/{pid}/task/{pid}"
    guardian.unwind = None
    guardian.stuck_reason = None
    return guardian


def _judge(pid: int, seconds: float, monkeypatch) -> tuple[str | None, list]:
    """Runs the deadline's checks on ``pid`` every interval for ``seconds``;
    (the stuck reason or None, the signals it would have sent)."""
    sent: list = []
    monkeypatch.setattr(monitor_process, "_send", lambda p, *sigs: sent.append((p, sigs)))
    guardian = _guardian(pid, time.monotonic())
    end = time.monotonic() + seconds
    while time.monotonic() < end and guardian.stuck_reason is None:
        guardian.enforce_unwind_deadline(time.monotonic())
        time.sleep(INTERVAL)
    return guardian.stuck_reason, sent


@contextlib.contextmanager
def _process(code: str, cpu: int | None = None, nice: int = 0) -> Iterator[subprocess.Popen]:
    def setup() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        if nice:
            os.nice(nice)

    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=setup)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.timeout(60)
def test_a_thread_asleep_in_the_kernel_is_stuck(monkeypatch):
    with _process("import time; time.sleep(600)") as proc:
        time.sleep(0.5)  # past the interpreter's start
        reason, sent = _judge(proc.pid, 30, monkeypatch)
    assert reason is not None and reason.startswith("stuck in native code after the abort")
    assert sent and sent[0][0] == proc.pid


@pytest.mark.timeout(60)
def test_a_computing_thread_is_not_stuck(monkeypatch):
    with _process(BUSY) as proc:
        reason, sent = _judge(proc.pid, 4 * UNWIND, monkeypatch)
    assert (reason, sent) == (None, [])


@pytest.mark.timeout(60)
def test_a_thread_starved_of_cpu_is_not_stuck(monkeypatch):
    # One core, two busy processes and a third at the lowest priority: the
    # third gets well under 1 % of the core, so it may go the whole deadline
    # without a clock tick of CPU, but it waits in the run queue, not in a
    # native call. (It used to be ended: its CPU was below half an interval.)
    cpu = min(os.sched_getaffinity(0))
    with _process(BUSY, cpu) as _, _process(BUSY, cpu) as _, _process(BUSY, cpu, 19) as starved:
        reason, sent = _judge(starved.pid, 4 * UNWIND, monkeypatch)
    assert (reason, sent) == (None, [])
