"""Nothing of a job outlives its launcher, however the launcher ends: with the
launcher's whole process group and its guard killed at once (SIGKILL, as by hand
or by a time limit), the job's store server (its own session, the port held) and
the workers left running end within :data:`OWNER_GRACE` seconds after."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from test_failover_e2e import ENV, RUN

from inprocess.failover.store_server import OWNER_GRACE
from inprocess.failover.supervisor import GUARD_GRACE, job_processes
from inprocess.procfs import process_start_time

pytestmark = pytest.mark.slow


def test_the_store_server_outlives_the_guard_s_grace():
    """An orderly end is the controller's and the guard's; the server's own is the
    fallback, after theirs."""
    assert OWNER_GRACE > GUARD_GRACE + 3  # (the guard's end_processes grace)


@pytest.mark.timeout(300)
def test_the_store_server_and_workers_end_when_launcher_guard_and_controller_are_killed(
    tmp_path: Path,
):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")  # no Wrapper: nothing else ends it
    state_dir = tmp_path / "state"
    job_id = f"killed-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp_path / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(
            [*RUN, "--nproc-per-node", "2", "--standby", "0", "--state-dir", str(state_dir),
             "--job-id", job_id, str(script)],
            env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        state: dict = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((state_dir / "state.json").read_text())
                if state.get("store") and all(
                    w.get("pid") for w in state["workers"].values()
                ):
                    break
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
            time.sleep(0.1)
        else:
            output = (tmp_path / "launcher.log").read_text()
            raise AssertionError(f"the job did not start\n{output}")
        left = [(state["store"]["pid"], state["store"]["start_time"])] + [
            (w["pid"], w["pid_start_time"]) for w in state["workers"].values()
        ]
        guards = [
            p for p in psutil.Process(launcher.pid).children()
            if "guard" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(guards) == 1, guards
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its controller
        guards[0].kill()
        launcher.wait()
        killed = time.monotonic()

        def alive() -> list[int]:
            return [pid for pid, start in left if process_start_time(pid) == start]

        while alive() and time.monotonic() < killed + OWNER_GRACE + 60:
            time.sleep(0.2)
        assert alive() == [], "the job's store server or workers outlived its launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for proc in job_processes(job_id):
            with contextlib.suppress(psutil.Error):
                proc.kill()
