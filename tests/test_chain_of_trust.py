"""What the job writes while it runs (its state, its worker logs, its records) lies
only where no other local user can swap it for something of theirs: the place
and every directory above it are this user's or root's, and a directory others
may write is sticky (``/tmp``). Another user is impersonated by ``chown`` to
uid 65534 (needs root).

The launcher refuses such a place by name before anything starts (its start is
a stub here, see ``test_launcher_inputs``); the Wrapper's records writer never
appends to a file another user planted."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_launcher_inputs import STARTED, no_start, refused, run  # noqa: F401 (fixture)

from inprocess import records as R
from inprocess.failover import console
from inprocess.failover.spec import JobSpec
from inprocess.ownership import distrust_chain

#: the other local user (nobody)
STRANGER = 65534


@pytest.fixture
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user (chown) needs root")


def strangers(path: Path, mode: int | None = None) -> Path:
    """``path`` handed to the other user (made a directory if missing)."""
    if not os.path.lexists(path):
        path.mkdir()
    if mode is not None:
        path.chmod(mode)
    os.lchown(path, STRANGER, STRANGER)
    return path


# ------------------------------------------------------------- the rule


def test_a_chain_is_trusted_only_if_nobody_else_can_change_a_step(tmp_path, as_root):
    assert distrust_chain(tmp_path / "not" / "made" / "yet") is None
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    sticky.chmod(0o1777)
    assert distrust_chain(sticky / "mine") is None  # like /tmp
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    why = distrust_chain(open_ / "mine")
    assert why is not None and f"{open_} " in why and "without the sticky bit" in why, why
    theirs = strangers(tmp_path / "theirs", 0o755)
    (theirs / "below").mkdir()
    why = distrust_chain(theirs / "below")
    assert why is not None and f"{theirs} is owned by uid {STRANGER}" in why, why
    # a symlink of theirs on the way (in a sticky dir, where they may replace it)
    (sticky / "link").symlink_to(tmp_path)
    os.lchown(sticky / "link", STRANGER, STRANGER)
    why = distrust_chain(sticky / "link" / "x")
    assert why is not None and f"{sticky / 'link'} is owned by uid {STRANGER}" in why, why
    # our own relative symlink is followed to what it names
    (tmp_path / "to-open").symlink_to("open")
    assert "without the sticky bit" in (distrust_chain(tmp_path / "to-open" / "x") or "")


# ------------------------------------------------------------- the launcher


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_start")
def test_a_log_dir_another_user_owns_or_can_rename_in_is_refused(tmp_path, as_root):
    """``--log-dir pub``, ``pub`` another user's: that user could rename the job's log
    directory away and put one of theirs in its place (with ``error.json`` a symlink
    to a file of root's, which torch in the worker opens by its path): refused, by
    name, and nothing is made in it. The same for a directory anyone may write
    without the sticky bit; one with it (like ``/tmp``) is fine."""
    pub = strangers(tmp_path / "pub", 0o755)
    err = refused(tmp_path, "--log-dir", str(pub), names="--log-dir")
    assert f"is owned by uid {STRANGER}" in err, err
    assert list(pub.iterdir()) == []
    # (refused before the state dir is made: the corrected rerun starts)
    assert not (tmp_path / "state").exists()
    below = pub / "logs"  # a directory of ours below theirs does not help
    below.mkdir()
    err = refused(tmp_path, "--log-dir", str(below), names="--log-dir")
    assert str(pub) in err, err
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    err = refused(tmp_path, "--log-dir", str(shared), names="--log-dir")
    assert "without the sticky bit" in err, err
    shared.chmod(0o1777)
    code, err = run(tmp_path, "--log-dir", str(shared))
    assert code == STARTED, err
    [made] = list(shared.iterdir())
    assert made.stat().st_uid == os.getuid() and stat.S_IMODE(made.stat().st_mode) == 0o750


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_start")
def test_a_state_dir_below_another_users_directory_is_refused(tmp_path, as_root):
    theirs = strangers(tmp_path / "theirs", 0o755)
    err = refused(
        tmp_path, "--state-dir", str(theirs / "state"), names="--state-dir", state=False
    )
    assert f"{theirs} is owned by uid {STRANGER}" in err, err
    assert list(theirs.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_start")
def test_records_planted_by_another_user_are_refused_and_never_written(
    tmp_path, as_root, monkeypatch
):
    """``INPROCESS_RECORDS`` naming a file another user planted in a sticky directory
    (``/tmp``'s mode), or one below a directory of theirs: the launcher refuses it
    by name, and the Wrapper's records writer appends nothing to it."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    planted = sticky / "records.jsonl"
    planted.write_text("theirs\n")
    strangers(planted, 0o666)
    theirs = strangers(tmp_path / "theirs", 0o755)
    below = theirs / "records.jsonl"
    for path, why in ((planted, f"is owned by uid {STRANGER}"), (below, f"{theirs} is owned")):
        monkeypatch.setenv(R.RECORDS_ENV, str(path))
        err = refused(tmp_path, names=R.RECORDS_ENV)
        assert why in err, err
        # the Wrapper's writer, as every rank of a job uses it
        recorder = R.Recorder(str(path), "0/0", "job/g0", 0)
        recorder.restore({"type": "restore", "time": 1.0, "step": 3})
        recorder = R.Recorder(str(path), "0/0", "job/g0", 0)
        recorder.completed(SimpleNamespace(index=0, members=["0/0"]), SimpleNamespace(rank=0))
        assert not recorder.enabled  # (one warning, then no more tries)
    assert planted.read_text() == "theirs\n"
    assert not below.exists()
    # a records file of ours, in a sticky directory, is written
    monkeypatch.delenv(R.RECORDS_ENV)
    ours = sticky / "ours.jsonl"
    R.append_jsonl(ours, {"type": "x"}, owned=True)
    assert R.read_jsonl(ours) == [{"type": "x"}]


def test_a_log_dir_whose_chain_changed_hands_is_not_written(tmp_path, as_root):
    """A worker's log directory below a directory that became another user's (the
    launcher checked it at the start): not made, so no ``error.json`` path goes
    to the worker either; its output goes to the console."""
    base = tmp_path / "base"
    base.mkdir()
    spec = JobSpec(
        job_id="j", entrypoint=("t.py",), nnodes=1, nproc_per_node=1,
        state_dir=str(tmp_path / "state"), log_dir=str(base / "job_1"), redirects="3",
    )  # fmt: skip
    (base / "job_1").mkdir(mode=0o750)  # (made by the launcher)
    stdout, stderr, env = console.worker_output(spec, 0, 0)
    assert "TORCHELASTIC_ERROR_FILE" in env and stdout and stderr
    strangers(base, 0o755)
    with pytest.raises(PermissionError, match=f"is owned by uid {STRANGER}"):
        console.make_log_dirs(spec, 1, 0)
    stdout, stderr, env = console.worker_output(spec, 0, 1)
    assert (stdout, stderr) == (None, None) and "TORCHELASTIC_ERROR_FILE" not in env
    assert not (base / "job_1" / "attempt_1").exists()
