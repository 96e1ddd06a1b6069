"""Another local user, and processes of the job's own machinery that break, change
nothing the job does (issue 36): a stranger's directory or symlink in a shared
temporary directory, a stranger's swap of a log directory, a monitor process that
cannot be replaced at once, a stopped standby zygote."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from test_failover_e2e import ENV, RUN, TRAIN, Launch, check_after_run

from inprocess.failover.supervisor import job_processes
from inprocess.userdir import USER_DIR_ENV

#: the other local user (nobody)
STRANGER = 65534


def _needs_a_stranger() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another local user (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv, to act as another local user")


def as_stranger(*argv: str) -> None:
    """Runs ``argv`` as the other local user; it must succeed."""
    ids = ["--reuid", str(STRANGER), "--regid", str(STRANGER), "--clear-groups"]
    subprocess.run(["setpriv", *ids, *argv], check=True, timeout=30)


@pytest.fixture
def public_tmp():
    """A directory of ours that the other local user can enter (the test's own
    ``tmp_path`` is private); removed at the end."""
    _needs_a_stranger()
    path = Path(tempfile.mkdtemp(prefix="hostile-local-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _shared_dir(path: Path) -> Path:
    """A directory every local user may write (``/tmp``'s mode)."""
    path.mkdir()
    path.chmod(0o1777)
    return path


def _job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if k not in (USER_DIR_ENV, "XDG_RUNTIME_DIR")}
    env.update(extra)
    return env


def _wait(predicate, timeout: float, what: str, output=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{output()}")


def _starts_since(launch: Launch, since: float, world: int = 2) -> set[int]:
    return {
        e["rank"]
        for e in launch.events()
        if e["kind"] == "start" and e["time"] > since and e["world"] == world
    }


def _finish_small(launch: Launch, timeout: float = 180.0) -> None:
    """Stops the 1 x 2 job at a step; both ranks finish at full size; nothing is left."""
    launch.stop()
    code = launch.finish(timeout)
    assert code == 0, launch.output()
    finishes = [e for e in launch.events() if e["kind"] == "finish"]
    assert sorted(e["rank"] for e in finishes) == [0, 1], launch.output()
    check_after_run(launch)


def _small(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Launch:
    """A job of one node with two workers, that trains until it is stopped."""
    return Launch(
        tmp,
        "--nnodes", "1", "--nproc-per-node", "2", *flags,
        env=env, script_args=["--steps", "1000000"],
    )  # fmt: skip


# ----------------------------------------------------------------- item 5 and (b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_strangers_user_dir_in_tmpdir_stops_no_job_and_the_job_id_lock_ignores_tmpdir(
    tmp_path, public_tmp
):
    """In a shared ``$TMPDIR``, ``inprocess-<uid>`` is a stranger's symlink to a
    stranger's directory (``$XDG_RUNTIME_DIR`` set too): the job runs anyway, in
    a private directory of its own, and writes nothing into the stranger's. A
    second launch of the same job id with another ``$TMPDIR`` is refused while
    the first runs."""
    shared = _shared_dir(public_tmp / "shared")
    evil = shared / "evil"
    as_stranger("mkdir", "-m", "777", str(evil))
    as_stranger("ln", "-s", str(evil), str(shared / f"inprocess-{os.getuid()}"))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = _job_env(TMPDIR=str(shared), XDG_RUNTIME_DIR=str(runtime))
    with _small(tmp_path, env=env) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(3), what="training")
        other_tmp = _shared_dir(public_tmp / "other")
        second = subprocess.run(
            [*RUN, "--nnodes", "1", "--nproc-per-node", "1", "--job-id", launch.job_id,
             "--state-dir", str(tmp_path / "second-state"), str(TRAIN)],
            env=_job_env(TMPDIR=str(other_tmp)), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stdout + second.stderr
        assert "already used by a live job" in second.stderr, second.stderr
        _finish_small(launch)
    assert list(evil.iterdir()) == []  # nothing of the job in the stranger's directory
    assert (shared / f"inprocess-{os.getuid()}").is_symlink()  # left alone
    ours = [p for p in shared.iterdir() if p.name.startswith(f"inprocess-{os.getuid()}-")]
    assert len(ours) == 1, list(shared.iterdir())  # one directory, every process found it
    info = ours[0].lstat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700


@pytest.mark.timeout(120)
def test_a_strangers_directory_in_tmpdir_does_not_stop_a_wrapped_call(
    single_rank, public_tmp, monkeypatch
):
    """``$TMPDIR/inprocess-<uid>`` made first by a stranger (mode 777): a rank under
    the Wrapper (its monitor process and node group) runs in a directory of its own."""
    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    shared = _shared_dir(public_tmp / "shared")
    theirs = shared / f"inprocess-{os.getuid()}"
    as_stranger("mkdir", "-m", "777", str(theirs))
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (read again from $TMPDIR)
    monkeypatch.delenv(USER_DIR_ENV, raising=False)

    @fast_wrapper()
    def train():
        dist.init_process_group("gloo")
        dist.destroy_process_group()
        return 7

    try:
        assert train() == 7
    finally:
        os.environ.pop(USER_DIR_ENV, None)  # (this test's, under its TMPDIR)
    assert list(theirs.iterdir()) == []
    ours = [p for p in shared.iterdir() if p.name.startswith(f"inprocess-{os.getuid()}-")]
    assert len(ours) == 1 and ours[0].lstat().st_uid == os.getuid(), list(shared.iterdir())


# ----------------------------------------------------------------- item 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swapped_log_directory_is_not_written_through(tmp_path, public_tmp):
    """The job's log subdirectory is moved away and a stranger's put in its place,
    whose ``stdout.log`` / ``stderr.log`` are symlinks to a file only root may
    read. (A ``--log-dir`` where a stranger could do that is refused at the
    launch, see ``test_chain_of_trust``; here root does it, for a stranger.)
    A relaunched worker's output is not appended to that file (its streams go
    to the console, and the refusal is logged); the job's own log directories
    were made private (0750)."""
    logs = public_tmp / "logs"
    logs.mkdir()
    logs.chmod(0o755)
    secret = public_tmp / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    flags = ("--log-dir", str(logs), "--redirects", "3")
    # (INFO: every incarnation of a worker writes to its log files)
    with _small(tmp_path, *flags, env=_job_env(TRAIN_LOG_LEVEL="INFO")) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(3), what="training")
        [mine] = list(logs.iterdir())
        attempt = next(mine.iterdir())
        modes = {p: p.stat().st_mode & 0o777 for p in (mine, attempt, attempt / "1")}
        # the swap: the job's directory renamed, a stranger's in its place
        mine.rename(logs / "moved")
        for generation in range(6):
            worker = mine / f"attempt_{generation}" / "1"
            worker.mkdir(parents=True)
            for name in ("stdout.log", "stderr.log"):
                (worker / name).symlink_to(secret)
        for path in (mine, *mine.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o777)
            os.lchown(path, STRANGER, STRANGER)
        since = time.time()
        os.kill(launch.state()["workers"]["1"]["pid"], signal.SIGKILL)
        launch.wait_until(lambda: 1 in _starts_since(launch, since), what="worker 1 relaunched")
        _finish_small(launch)
        assert (logs / "moved" / attempt.name / "1" / "stderr.log").stat().st_size > 0
        assert secret.read_text() == "root only\n", launch.output()
        assert "not written to its log files" in launch.output(), launch.output()
    assert set(modes.values()) == {0o750}, modes  # the job's own, made private


# ----------------------------------------------------------------- item 3


@pytest.mark.timeout(180)
def test_a_monitor_process_killed_while_it_is_replaced_is_replaced_again(
    single_rank, tmp_path
):
    """The monitor process is killed, then its replacement while it starts: a third
    one monitors the rank (the keeper tries again, it does not give up)."""
    from test_call_lifecycle import fast_wrapper

    pidfile = tmp_path / "monitor.pid"
    me = psutil.Process()
    seen: list[int] = []

    def children() -> set[int]:
        """This process's monitor processes (spawned, or forked: our command line)."""
        found = set()
        for child in me.children():
            with contextlib.suppress(psutil.Error):
                argv = child.cmdline()
                if child.status() != psutil.STATUS_ZOMBIE and (
                    "inprocess.monitor_process_main" in argv
                    or argv == me.cmdline()
                    or child.name().startswith("inproc-monitor")  # (it renames itself)
                ):
                    found.add(child.pid)
        return found

    def new_child(known: set[int]) -> int | None:
        fresh = children() - known
        return min(fresh) if fresh else None

    @fast_wrapper(monitor_process_pidfile=str(pidfile))
    def train():
        # (never raises: the Wrapper would call it again)
        try:
            return replaced_twice()
        except Exception as ex:
            return ex

    def replaced_twice():
        first = int(pidfile.read_text())
        known = children()
        os.kill(first, signal.SIGKILL)
        _wait(lambda: new_child(known) is not None, 60, "a replacement monitor process")
        second = new_child(known)
        os.kill(second, signal.SIGKILL)  # while it starts (it imports for seconds)
        # the pid file names the monitor process once it is ready
        _wait(
            lambda: pidfile.read_text().strip() not in (str(first), str(second)),
            60,
            "a third monitor process, ready",
        )
        third = int(pidfile.read_text())
        time.sleep(1.0)
        assert psutil.Process(third).is_running() and third in children()
        seen.extend([first, second, third])
        return 1

    result = train()
    assert result == 1, repr(result)
    assert len(set(seen)) == 3


# ----------------------------------------------------------------- item 4


def _zygotes(job_id: str) -> list[psutil.Process]:
    found = []
    for proc in job_processes(job_id):
        with contextlib.suppress(psutil.Error):
            if "--zygote" in proc.cmdline():
                found.append(proc)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_zygote_does_not_blind_the_controller(tmp_path):
    """The node's standby zygote is stopped (SIGSTOP), then a worker forked from it
    is killed: the controller does not wait for the zygote's report for ever (it
    kills the zygote, reads the subreaper's record), relaunches the worker, and
    the job ends at once on SIGTERM."""
    with _small(tmp_path) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(3), what="training")
        [zygote] = _zygotes(launch.job_id)
        worker = psutil.Process(launch.state()["workers"]["1"]["pid"])
        assert worker.ppid() == zygote.pid  # forked from it
        zygote.suspend()
        since = time.time()
        worker.kill()
        launch.wait_until(
            lambda: _starts_since(launch, since) == {0, 1}, 120, what="full size again"
        )
        assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE
        assert "does not answer" in launch.output() or "no exit report" in launch.output()
        asked = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        launch.finish(60)
        assert time.monotonic() - asked < 60
        check_after_run(launch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_with_its_zygote_is_not_charged_as_a_worker_failure(tmp_path):
    """The node's zygote and a worker it forked are killed together (SIGKILL): the
    worker is relaunched, its death charged to the machinery (logged as such), not
    counted against its ``--max-restarts``."""
    with _small(tmp_path, "--max-restarts", "0") as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(3), what="training")
        [zygote] = _zygotes(launch.job_id)
        worker = psutil.Process(launch.state()["workers"]["1"]["pid"])
        assert worker.ppid() == zygote.pid  # forked from it
        since = time.time()
        zygote.kill()
        worker.kill()
        launch.wait_until(
            lambda: _starts_since(launch, since) == {0, 1}, 120, what="full size again"
        )
        state = launch.state()
        assert state["worker_restarts"].get("1", 0) == 0, state["worker_restarts"]
        assert "killed with its standby zygote" in launch.output(), launch.output()
        _finish_small(launch)
