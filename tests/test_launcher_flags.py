"""``inprocess-run``'s torchrun-style flags and its console: tiny workers that print and exit.

-m, --no-python, --standalone, --master-port, per-worker log files
(--log-dir, --redirects, --tee), --local-ranks-filter, the errors for torchrun
flags we do not take, and the status line on a terminal versus a pipe.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from inprocess._net import free_port
from inprocess.failover import cli
from inprocess.failover.state import StateError

# tiny workers without torch: spawned (a standby zygote would import torch for them)
RUN = [sys.executable, "-m", "inprocess.failover.cli", "--standby", "0"]
ENV = dict(
    os.environ,
    RES_OPTIONS="timeout:1 attempts:1",
    PYTHONWARNINGS="ignore:Failed to initialize NumPy",
)

#: appends a restart record (as the Wrapper writes them) to the job's state dir
#: (``TEST_STATE_DIR``), with a torn line after it, then lives ``TEST_LINGER`` seconds
#: (long enough for a few redraws of the status line)
RECORD = """\
import json, os, time
if os.environ.get("TEST_STATE_DIR") and os.environ["RANK"] == "0":
    record = {"type": "restart", "time": time.time(), "iteration": 7, "world_size": 1,
              "faults": [{"rank": 1, "initial_rank": 1, "cause": "exception",
                          "detail": "ValueError: boom"}],
              "terminated": [1], "activated": [], "phases": {}, "latency": 0.5}
    with open(os.path.join(os.environ["TEST_STATE_DIR"], "restarts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n" + '{"type": "restart", "torn')
time.sleep(float(os.environ.get("TEST_LINGER", 0)))
"""

#: prints one line to stdout and one to stderr, naming its rank and what it was given.
#: Each line is one write: with PYTHONUNBUFFERED (the launcher sets it for a worker
#: writing to a file) print() writes the text and its newline apart, and on the
#: console both streams share, a line of another process (the launcher's log, a
#: tee'd line) could land between them.
HELLO = """\
import os, sys
rank = os.environ["RANK"]
sys.stdout.write(f"out rank {rank} port {os.environ['MASTER_PORT']} args {sys.argv[1:]}\\n")
sys.stderr.write(f"err rank {rank}\\n")
""" + RECORD


def launch(
    tmp: Path, *flags: str, env: dict[str, str] = ENV
) -> subprocess.CompletedProcess[str]:
    """Runs one job to its end; its stdout and stderr as text."""
    return subprocess.run(
        [*RUN, "--state-dir", str(tmp / "state"), "--monitor-interval", "0.05", *flags],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_module_log_files_tee_and_rank_filter(tmp_path: Path) -> None:
    """-m runs a module; rank 0's stdout goes to its file only (--redirects 0:1), rank 1's
    streams to files and, prefixed, to the console (--tee 1:3); rank 2 is filtered out."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "hello.py").write_text(HELLO)
    port = free_port()
    result = launch(
        tmp_path,
        "--nproc-per-node", "3", "--master-port", str(port), "--log-dir", "logs",
        "--redirects", "0:1", "--tee", "1:3", "--local-ranks-filter", "0,1",
        "-m", "pkg.hello", "a", "--b",
        env=dict(ENV, TEST_STATE_DIR=str(tmp_path / "state")),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out, err = result.stdout, result.stderr
    # In a pipe: no status line, a plain log line for the restart record instead.
    assert "\x1b[" not in out + err
    assert (
        "in-process restart at iteration 7 (world size 1): rank 1 exception: ValueError: boom; "
        "recovered in 0.50s"
    ) in err
    # rank 0: stdout in its file only, stderr on the console as it is
    [run_dir] = (tmp_path / "logs").iterdir()
    assert run_dir.name.startswith("job-")  # <job id>_<random>, as torchrun's <run id>_<random>
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == (
        f"out rank 0 port {port} args ['a', '--b']\n"
    )
    assert not (attempt / "0" / "stderr.log").exists()
    assert "out rank 0" not in out and "err rank 0\n" in err
    # rank 1: both streams in files and on the console, prefixed like torchrun's
    assert (attempt / "1" / "stderr.log").read_text() == "err rank 1\n"
    assert f"[default1]:out rank 1 port {port} args ['a', '--b']\n" in out
    assert "[default1]:err rank 1\n" in err
    # rank 2: not in the filter, not redirected: nowhere
    assert "rank 2" not in out + err
    assert not list((attempt / "2").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_python_standalone_quiet(tmp_path: Path) -> None:
    program = tmp_path / "hello.sh"
    program.write_text('#!/bin/sh\necho "program rank $RANK at $MASTER_ADDR with $1"\n')
    program.chmod(0o755)
    result = launch(
        tmp_path, "--quiet", "--standalone", "--nproc_per_node", "2",
        "--no-python", "./hello.sh", "x",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"program rank {rank} at 127.0.0.1 with x" in result.stdout
    assert result.stderr == ""  # --quiet: no log line of inprocess-run's own


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--rdzv-conf", "join_timeout=5"], "no rendezvous to configure"),
        (["--role", "trainer"], "no roles"),
    ],
)
def test_torchrun_only_flags_say_what_to_use(flags, says, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*flags, str(tmp_path / "train.py")])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["-m", "--no-python"], "exclude each other"),
        (["--standalone", "--master-addr", "10.0.0.1"], "--standalone picks"),
        (["--backend", "ray", "--tee", "3"], "work with --backend local only"),
        (["--local-ranks-filter", "0,x"], "comma-separated list"),
        (["--redirects", "4"], "must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--no-python"], "neither a command on PATH"),
    ],
)
def test_bad_launch_flags(flags, says, tmp_path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    target = "no-such-program-x" if flags == ["--no-python"] else str(script)
    code = cli.main([*flags, "--state-dir", str(tmp_path / "s"), target])
    err = capsys.readouterr().err
    assert code == 2
    assert says in err or (flags[0] == "--backend" and "needs Ray" in err), err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_status_line_on_a_terminal_not_in_a_pipe(tmp_path: Path) -> None:
    script = tmp_path / "record.py"
    script.write_text(RECORD + "print('worker done')\n")
    state = tmp_path / "state"

    # On a pseudo-terminal: one status line in the bottom row, released at the end.
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    try:
        proc = subprocess.Popen(
            [*RUN, "--state-dir", str(state), "--monitor-interval", "0.05", str(script)],
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=tmp_path,
            env=dict(ENV, TERM="xterm", TEST_STATE_DIR=str(state), TEST_LINGER="2"),
        )  # fmt: skip
        os.close(slave)
        slave = -1
        screen = _read_until_closed(master, proc, timeout=90)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert proc.returncode == 0, screen
    text = screen.decode(errors="replace")
    assert "\x1b[1;23r" in text  # the scroll region: every row but the last
    assert "\x1b[24;1H\x1b[2K" in text  # the status line drawn in the last row
    assert "| restarts 0 |" in text  # before the record
    assert re.search(r"gen 0 \| world 1/1 \| alive [01]/1 \| restarts 1 \|", text)
    assert "last fault: rank 1 exception: ValueError: boom, recovered in 0.50s" in text
    given_back = text[text.rindex("\x1b[r") :]  # the region reset, the status row cleared
    assert given_back.startswith("\x1b[r\x1b8\x1b7\x1b[24;1H\x1b[2K\x1b8")
    assert "restarts 1" in given_back  # the last status stays as an ordinary line
    assert "worker done" in text


def _read_until_closed(master: int, proc: subprocess.Popen, timeout: float) -> bytes:
    """Everything written to the terminal until the last writer is gone."""
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError as ex:  # EIO: every slave end is closed
                if ex.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    return b"".join(chunks)


def test_nproc_per_node_words_and_a_taken_master_port(tmp_path, capsys) -> None:
    assert cli._nproc_per_node("cpu") == os.cpu_count()
    assert cli._nproc_per_node("auto") >= 1
    assert cli._nproc_per_node("4") == 4
    script = tmp_path / "train.py"
    script.write_text("")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = cli.main(
            ["--master-port", str(port), "--state-dir", str(tmp_path / "s"), str(script)]
        )
    assert code == 2
    assert f"--master-port {port}: cannot listen on 127.0.0.1" in capsys.readouterr().err


# ----------------------------------------------------------------- the job id's lock


def test_a_job_id_lock_is_exclusive_and_its_file_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_lock_dir", lambda: tmp_path)
    first = cli.lock_job_id("j")
    with pytest.raises(StateError, match=r"--job-id 'j' is already used by a live job .*pid \d+"):
        cli.lock_job_id("j")
    first.release()
    assert not (tmp_path / "job-j.lock").exists()
    first.release()  # (idempotent)
    second = cli.lock_job_id("j")
    assert (tmp_path / "job-j.lock").exists()
    second.release()
    assert list(tmp_path.iterdir()) == []


def test_a_job_id_lock_won_on_a_file_its_holder_just_removed_is_taken_again(
    tmp_path, monkeypatch
):
    """The race of removing a lock file: a launch opens the file, the job holding
    it ends (removes the file, gives the lock up), the launch then wins the lock
    on the removed file. It must not count: a third launch would create the file
    anew and win too (two live jobs with one id)."""
    monkeypatch.setattr(cli, "_lock_dir", lambda: tmp_path)
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            (tmp_path / "job-j.lock").unlink()  # the holder ended between open and flock
        return real_flock(fd, op)

    monkeypatch.setattr(cli.fcntl, "flock", flock)
    lock = cli.lock_job_id("j")
    assert len(calls) == 2  # the open was made again
    assert cli._same_file(lock.fd, tmp_path / "job-j.lock")
    monkeypatch.setattr(cli.fcntl, "flock", real_flock)
    with pytest.raises(StateError):
        cli.lock_job_id("j")  # the file the path names is the one held
    lock.release()
