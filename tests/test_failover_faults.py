"""inprocess-run under bad input and machinery faults: bounded, truthful, one clear
error (issue 25): stop requests inside long actions, a disk that refuses the
state, a damaged state file, flag errors, planted symlinks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_failover_e2e import ENV, RUN, TRAIN, Launch

from inprocess.failover import cli
from inprocess.failover.supervisor import job_processes


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main([*args, str(TRAIN)])
    return code, err.getvalue()


def _one_line_error(result: tuple[int, str], *words: str) -> str:
    code, stderr = result
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("inprocess-run: error:"), stderr
    for word in words:
        assert word in lines[0], stderr
    return lines[0]


# ------------------------------------------------------------- flags (item 4, item 1)


def test_flag_errors_name_the_flag_and_leave_nothing(tmp_path):
    state_dir = tmp_path / "state"
    a_file = tmp_path / "file"
    a_file.write_text("")
    line = _one_line_error(
        _cli("--state-dir", str(state_dir), "--log-dir", str(a_file / "logs")), "--log-dir"
    )
    assert "--state-dir" not in line
    assert not state_dir.exists(), "a refused start left the state dir behind"
    # an existing (empty, private) state dir is left as it was, with no state.json
    state_dir.mkdir(mode=0o700)
    _one_line_error(_cli("--state-dir", str(state_dir), "--log-dir", str(a_file)), "--log-dir")
    assert list(state_dir.iterdir()) == []
    # the default log dir, <state-dir>/logs, planted as a symlink: refused, not followed
    outside = tmp_path / "outside"
    outside.mkdir()
    (state_dir / "logs").symlink_to(outside)
    _one_line_error(_cli("--state-dir", str(state_dir), "--redirects", "3"), "--state-dir", "symlink")
    assert list(outside.iterdir()) == [] and not (state_dir / "state.json").exists()
    (state_dir / "logs").unlink()
    # larger than the machine can hold: refused at once, by name
    line = _one_line_error(
        _cli("--state-dir", str(state_dir), "--nproc-per-node", "100000"), "--nproc-per-node"
    )
    assert str(cli.local_capacity()) in line
    assert list(state_dir.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_corrected_rerun_with_the_same_state_dir_starts(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    flags = ("--nnodes", "1", "--nproc-per-node", "1", "--state-dir", str(tmp_path / "state"))
    refused = subprocess.run(
        [*RUN, *flags, "--log-dir", str(a_file), str(TRAIN), "--steps", "2"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--log-dir" in refused.stderr, refused.stderr
    done = subprocess.run(
        [*RUN, *flags, "--log-dir", str(tmp_path / "logs"), str(TRAIN), "--steps", "2"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-4000:]
