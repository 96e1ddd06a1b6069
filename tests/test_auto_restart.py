"""``monitor_and_restart``: the whole process restarted from inside it, in real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from inprocess.auto_restart import monitor_and_restart

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from inprocess.auto_restart import monitor_and_restart

    attempts = sys.argv[1]
    monitor_and_restart(restart_delay=0.05)
    with open(attempts, "a") as f:
        f.write(f"{os.getpid()}\\n")
    n = len(open(attempts).read().split())
    if n == 1:
        sys.exit(3)                           # a failure: restarted
    if n == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # killed: restarted
    print(f"done after {n} attempts", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_failing_child_is_forked_again_until_one_exits_0(tmp_path):
    attempts = tmp_path / "attempts"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(attempts)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done after 3 attempts\n"
    children = attempts.read_text().split()
    assert len(set(children)) == 3  # three processes, one after the other
    lines = proc.stderr.splitlines()
    assert lines == [
        "Starting self-monitoring mode",
        f"Launched child {children[0]}",
        f"Child {children[0]} exited with status 3",
        f"Launched child {children[1]}",
        f"Child {children[1]} exited with signal 9",
        f"Launched child {children[2]}",
        f"Child {children[2]} exited with status 0",
    ]


@pytest.mark.parametrize("bad", [-1, "5", None, True, float("nan")])
def test_a_bad_restart_delay_is_refused_before_anything_forks(bad):
    with pytest.raises(ValueError, match=r"restart_delay=\.\.\.\) must be a number of seconds"):
        monitor_and_restart(restart_delay=bad)
