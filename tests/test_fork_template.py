"""Ranks forked from the suite's fork template behave as spawned ``python SCRIPT`` ranks:
exit status, signals, output, environment (as tools see it too), directory, stdin,
session; a rank whose start-up environment differs is spawned."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import launcher
import psutil
import pytest
from launcher import MARKER, Job

from inprocess.tools.fork_template import ForkedProcess

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    print("argv", sys.argv[1:], "rank", os.environ["RANK"], "cwd", os.getcwd())
    print("stdin", os.readlink("/proc/self/fd/0"), "session", os.getsid(0) == os.getpid())
    print("path0", sys.path[0] == os.path.dirname(os.path.realpath(__file__)))
    if sys.argv[1] == "sleep":
        print("sleeping", flush=True)
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.timeout(120)
def test_a_forked_rank_is_a_rank_as_spawned(tmp_path, script):
    if launcher.TEMPLATE is None:
        pytest.skip("INPROCESS_TEST_FORK=0: ranks are spawned")
    with Job(script, 2, tmp_path / "exit", args=["7"]) as job:
        assert all(isinstance(p, ForkedProcess) for p in job.procs)
        environ = psutil.Process(job.pid(1)).environ()  # what tools see: the rank's own
        result = job.wait(60)
    assert environ.get(MARKER) == job.marker and environ.get("RANK") == "1", environ
    assert result.returncodes == [7, 7], result.describe()
    out = result.ranks[1].output
    assert "argv ['7'] rank 1 cwd " + os.getcwd() in out, out
    assert "stdin /dev/null session True" in out and "path0 True" in out, out
    assert not result.leftovers

    with Job(script, 1, tmp_path / "kill", args=["sleep"]) as job:
        deadline = time.monotonic() + 60
        while "sleeping" not in job.logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(subprocess.TimeoutExpired):
            job.procs[0].wait(0.2)
        os.killpg(job.pid(0), signal.SIGKILL)  # its own session, as a spawned rank's
        assert job.procs[0].wait(30) == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_rank_with_another_startup_environment_is_spawned(tmp_path, script):
    with Job(script, 1, tmp_path, args=["3"], env={"TORCH_SHOW_CPP_STACKTRACES": "1"}) as job:
        assert isinstance(job.procs[0], subprocess.Popen)
        result = job.wait(90)
    assert result.returncodes == [3], result.describe()
