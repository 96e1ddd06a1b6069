"""SIGUSR1 (a scheduler's warning that the job ends soon): the job's machinery
survives it, a Wrapper rank takes it as a request to persist its next snapshot,
a handler of the user's own is kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from inprocess import persist_signal
from inprocess.snapshot.persist import Persister

REPO = Path(__file__).resolve().parent.parent


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_the_machinery_survives_sigusr1_and_a_rank_takes_it_over():
    result = _child(
        "import os, signal\n"
        "from inprocess import persist_signal as s\n"
        "s.survive()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"  # the default would end the process
        "assert not s.take()\n"  # the machinery only survives it
        "assert s.install_in_rank()\n"  # a rank forked from a zygote takes it over
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "assert s.take() and not s.take()\n"  # one request, consumed once
        "print('alive')\n"
    )
    assert result.returncode == 0 and result.stdout == "alive\n", result.stderr


def test_a_handler_of_the_user_s_own_is_kept():
    result = _child(
        "import os, signal\n"
        "from inprocess import persist_signal as s\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR1, lambda n, f: seen.append(n))\n"
        "s.survive()\n"
        "assert not s.install_in_rank()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "assert seen == [signal.SIGUSR1] and not s.take()\n"
        "print('kept')\n"
    )
    assert result.returncode == 0 and result.stdout == "kept\n", result.stderr


def test_a_request_makes_the_next_step_due_once(tmp_path):
    persister = Persister(str(tmp_path), 100)
    try:
        assert not persister.due(7)
        persist_signal.request()
        assert persister.due(7)  # whatever the step
        assert not persister.due(8)
        assert persister.due(200)
    finally:
        persister.close()
