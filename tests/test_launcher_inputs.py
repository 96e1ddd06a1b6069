"""``inprocess-run``'s last unbounded inputs: every bad flag, path or variable ends in
one clear line naming it, before anything starts.

Most tests call :func:`inprocess.failover.cli.main` in this process with the
job's start replaced by a stub (:func:`no_start`): a refusal returns 2 (or
argparse exits 2) and names the flag; an input that is wrongly accepted reaches
the stub, which the test sees as exit code 99, without starting a process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from inprocess import records as R
from inprocess.failover import cli, console
from inprocess.failover.spec import MAX_JOB_ID, JobSpec

#: what the stub start returns: the input was accepted
STARTED = 99


class _NoSupervisor:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def run(self) -> int:
        return STARTED


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job is never started: :class:`cli.Supervisor` is a stub returning 99."""
    monkeypatch.setattr(cli, "Supervisor", _NoSupervisor)
    monkeypatch.delenv("INPROCESS_JOB_SECRET", raising=False)
    # cli.main puts the job's variables into os.environ: restore them afterwards
    for name in ("INPROCESS_JOB_ID", "INPROCESS_RUN_TOKEN", "INPROCESS_JOB_SECRET"):
        monkeypatch.setenv(name, "x" * 32)
        monkeypatch.delenv(name)


def run(tmp_path: Path, *flags: str, state: bool = True) -> tuple[int, str]:
    """``inprocess-run [--state-dir tmp/state] FLAGS train.py``: its exit code and stderr
    (argparse's exits included)."""
    script = tmp_path / "train.py"
    script.write_text("")
    argv = [*(("--state-dir", str(tmp_path / "state")) if state else ()), *flags, str(script)]
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f, contextlib.redirect_stderr(f):
        try:
            code = cli.main(argv)
        except SystemExit as ex:
            code = ex.code if isinstance(ex.code, int) else 2
    return code, err.read_text()


def refused(tmp_path: Path, *flags: str, names: str, state: bool = True) -> str:
    code, err = run(tmp_path, *flags, state=state)
    assert code == 2, f"accepted (exit {code}): {flags}\n{err}"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("inprocess-run: error:")]
    assert len(errors) == 1 and names in errors[0], err  # (argparse's usage lines first)
    return err


# ------------------------------------------------------------- standbys and spare nodes


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--standby", "100000"], "--standby"),
        (["--spare-nodes", "1000000000"], "--spare-nodes"),
        (["--nnodes", "1000000000"], "--nnodes"),
        (["--nproc-per-node", "100000000"], "--nproc-per-node"),
    ],
)
def test_standbys_and_spare_nodes_are_bounded(flags, names, tmp_path, no_start) -> None:
    """No fork storm: a count beyond the allowed range is refused by name, with the range."""
    err = refused(tmp_path, *flags, names=names)
    assert "0.." in err or "1.." in err, err
    assert not (tmp_path / "state").exists()


@pytest.mark.timeout(60)
def test_the_machine_check_counts_standbys_and_their_zygotes(tmp_path, no_start) -> None:
    """Workers that fit the machine, plus standbys on every node slot that do not."""
    capacity = cli.local_capacity()
    nproc = max(1, capacity // 2)
    err = refused(
        tmp_path, "--nproc-per-node", str(nproc), "--spare-nodes", "1",
        "--standby", str(nproc), names="--standby",
    )  # fmt: skip
    assert "--spare-nodes" in err and str(capacity) in err, err
    # without the standbys, the same launch fits
    code, err = run(tmp_path, "--nproc-per-node", str(nproc), "--standby", "0")
    assert code == STARTED, err


# ------------------------------------------------------------- numbers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--monitor-interval", "1e308"),
        ("--monitor-interval", "inf"),
        ("--monitor-interval", "nan"),
        ("--monitor-interval", "0"),
        ("--monitor-interval", "0.00001"),
        ("--max-restarts", "-1"),
        ("--max-restarts", str(10**30)),
        ("--per-node-max-failures", "0"),
        ("--per-node-max-failures", str(10**30)),
        ("--job-max-restarts", str(10**30)),
        ("--node-max-relaunches", str(10**30)),
        ("--max-controller-restarts", str(10**30)),
        ("--spare-nodes", "-1"),
        ("--standby", "-1"),
        ("--nnodes", "0"),
        ("--nproc-per-node", "0"),
        ("--master-port", "70000"),
        ("--master-port", "x"),
        ("--max-restarts", "1.5"),
        ("--join-timeout", "-1"),
        ("--join-timeout", "inf"),
        ("--standby-join-timeout", "1e9"),
    ],
)
def test_every_number_is_range_checked_by_name(flag, value, tmp_path, no_start) -> None:
    err = refused(tmp_path, flag, value, names=flag)
    assert "OverflowError" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "bundle", ['{"CPU": Infinity}', '{"CPU": 1e308}', '{"CPU": NaN}', '{"GPU": true}', "[" * 10**5]
)
def test_ray_bundle_amounts_are_range_checked(bundle, tmp_path, no_start) -> None:
    """Refused while parsing, before any Ray cluster is reached."""
    pytest.importorskip("ray")
    refused(tmp_path, "--backend", "ray", "--ray-bundle", bundle, names="--ray-bundle")


# ------------------------------------------------------------- addresses, paths, ids


@pytest.mark.timeout(60)
def test_an_unresolvable_master_addr_is_refused_by_name(tmp_path, no_start, monkeypatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")
    err = refused(tmp_path, "--master-addr", "no-such-host.invalid", names="--master-addr")
    assert "no-such-host.invalid" in err and "resolve" in err, err
    assert not (tmp_path / "state").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--state-dir", ""], "--state-dir"),
        (["--state-dir", "/"], "--state-dir"),
        (["--log-dir", ""], "--log-dir"),
    ],
)
def test_empty_and_root_directories_are_refused(flags, names, tmp_path, no_start, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(tmp_path, *flags, names=names, state=flags[0] != "--state-dir")
    assert {p.name for p in tmp_path.iterdir()} <= {"train.py", "stderr.txt"}


@pytest.mark.timeout(60)
def test_a_long_job_id_is_blamed_on_the_job_id(tmp_path, no_start, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # (the default state dir: ./inprocess-runs/<job-id>)
    err = refused(tmp_path, "--job-id", "j" * 300, names="--job-id", state=False)
    assert "--state-dir" not in err and "j" * 300 not in err, err
    refused(tmp_path, "--job-id", "a/b", names="--job-id")
    # the longest id allowed starts
    code, err = run(tmp_path, "--job-id", "j" * MAX_JOB_ID, state=False)
    assert code == STARTED, err


@pytest.mark.timeout(60)
def test_a_short_job_secret_is_refused(tmp_path, no_start, monkeypatch) -> None:
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "x")
    err = refused(tmp_path, names="INPROCESS_JOB_SECRET")
    assert "at least 16" in err, err
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "s" * 16)
    code, err = run(tmp_path)
    assert code == STARTED, err


@pytest.mark.timeout(60)
def test_a_standalone_wrapper_refuses_a_short_job_secret(monkeypatch) -> None:
    import inprocess

    monkeypatch.setenv("INPROCESS_JOB_SECRET", "x")
    called = []
    wrapped = inprocess.Wrapper(store_kwargs={"port": 1})(lambda: called.append(1))
    with pytest.raises(ValueError, match="INPROCESS_JOB_SECRET must be at least 16"):
        wrapped()
    assert not called


# ------------------------------------------------------------- what is on disk


@contextlib.contextmanager
def shared_tmp() -> Iterator[Path]:
    """A world-writable sticky directory (like /tmp) that another uid can reach."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("planting a stranger's symlink needs root and setpriv")
    path = Path(tempfile.mkdtemp(prefix="inprocess-shared-", dir="/tmp"))
    try:
        path.chmod(0o1777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_stranger(*argv: str) -> None:
    """Runs ``argv`` as uid/gid 65534 (nobody)."""
    subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *argv],
        check=True, timeout=30,
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_a_strangers_symlink_as_state_dir_is_refused(tmp_path, no_start) -> None:
    """Another user's symlink at the --state-dir path (or above it) is refused, even when it
    points to a private directory of ours: that user could point it elsewhere at any time."""
    with shared_tmp() as shared:
        ours = shared / "ours"
        ours.mkdir(mode=0o700)
        as_stranger("ln", "-s", str(ours), str(shared / "state"))
        as_stranger("ln", "-s", str(shared), str(shared / "up"))
        for path in (shared / "state", shared / "up" / "ours" / "job"):
            code, err = run(tmp_path, "--state-dir", str(path), state=False)
            assert code == 2, err
            assert "--state-dir" in err and "symlink" in err and "65534" in err, err
        assert list(ours.iterdir()) == []
        # our own symlink is ours to follow
        (shared / "mine").symlink_to(ours)
        code, err = run(tmp_path, "--state-dir", str(shared / "mine"), state=False)
        assert code == STARTED, err
        assert (ours / "state.json").is_file()


@pytest.mark.timeout(60)
def test_a_records_file_planted_as_a_symlink_is_never_written_through(tmp_path, no_start):
    """A symlink at <state-dir>/restarts.jsonl (planted by anyone) is refused by the launcher;
    one planted once the job runs is not written through by the Wrapper's records."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / R.RESTARTS_FILE).symlink_to(victim)
    err = refused(tmp_path, names=R.RESTARTS_FILE)
    assert "symlink" in err and "--state-dir" in err, err

    # the Wrapper's writer (what the job's ranks append through)
    recorder = R.Recorder(str(state / R.RESTARTS_FILE), "0/0", "job/g0", 0)
    recorder.restore({"type": "restore", "time": 1.0, "step": 3})
    recorder = R.Recorder(str(state / R.RESTARTS_FILE), "0/0", "job/g0", 0)
    recorder.completed(SimpleNamespace(index=0, members=["0/0"]), SimpleNamespace(rank=0))
    assert victim.read_text() == "precious\n"
    assert stat.S_ISLNK(os.lstat(state / R.RESTARTS_FILE).st_mode)


# ------------------------------------------------------------- what workers print


@pytest.mark.timeout(60)
def test_a_partial_line_of_a_teed_log_is_bounded(tmp_path) -> None:
    """A progress bar without a newline: what is held back stays under the bound, and the
    line reaches the console in pieces of at most that bound, every byte of it."""
    spec = JobSpec(
        job_id="j", entrypoint=["t.py"], nnodes=1, nproc_per_node=1,
        state_dir=str(tmp_path), log_dir=str(tmp_path / "logs"), tee="1",
    )  # fmt: skip
    path = console.worker_log_dir(spec, 0, 0) / "stdout.log"
    path.parent.mkdir(parents=True)
    shown = tmp_path / "console.txt"
    out = os.open(shown, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    tailer = console.LogTailer(spec)
    tailer._tailed = [(0, "stdout", out)]  # the console: a file
    try:
        with open(path, "ab") as f:
            for _ in range(64):  # 4 MiB in 64 KiB pieces, no newline
                f.write(b"#" * 65536)
                f.flush()
                tailer.poll()
                assert max(map(len, tailer._partial.values()), default=0) < console.MAX_LINE
            f.write(b"#" * 100 + b"\n")
        tailer.poll(final=True)
    finally:
        os.close(out)
    lines = shown.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert all(line.startswith(b"[default0]:") for line in lines[:-1])
    assert max(map(len, lines)) <= console.MAX_LINE + len(b"[default0]:")
    assert sum(len(line) - len(b"[default0]:") for line in lines[:-1]) == 64 * 65536 + 100


#: a worker printing a 6 MiB progress bar without a newline, then a restart record
#: whose fault's text carries terminal escape sequences
NOISY = r"""
import json, os, sys, time
for i in range(96):
    sys.stdout.write("#" * 65536)
    sys.stdout.flush()
print(" done")
record = {"type": "restart", "time": time.time(), "iteration": 1, "world_size": 1,
          "faults": [{"rank": 0, "initial_rank": 0, "cause": "exception",
                      "detail": "ValueError: \x1b[2J\x1b]0;pwned\x07bad\rline"}],
          "terminated": [], "activated": [], "phases": {}, "latency": 0.5}
with open(os.environ["INPROCESS_RECORDS"], "a") as f:
    f.write(json.dumps(record) + "\n")
time.sleep(1.5)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_teed_progress_bar_and_escapes_in_a_workers_fault(tmp_path: Path) -> None:
    """One job: a 6 MiB line reaches the console in bounded pieces, and the launcher's log
    line of the worker's fault shows its control characters escaped."""
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    proc = subprocess.run(
        [
            sys.executable, "-m", "inprocess.failover.cli", "--standby", "0",
            "--state-dir", str(tmp_path / "state"), "--monitor-interval", "0.05",
            "--tee", "1", str(script),
        ],
        cwd=tmp_path, capture_output=True, timeout=150,
        env=dict(os.environ, PYTHONWARNINGS="ignore:Failed to initialize NumPy"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.split(b"\n")
    assert sum(line.count(b"#") for line in lines) == 96 * 65536
    assert max(map(len, lines)) <= console.MAX_LINE + 16
    assert b" done" in proc.stdout
    err = proc.stderr.decode(errors="replace")
    assert "in-process restart at iteration 1" in err, err
    assert "\x1b" not in err and "\x07" not in err and "\r" not in err, err
    assert r"ValueError: \x1b[2J\x1b]0;pwned\x07bad" in err, err  # (its first line)
