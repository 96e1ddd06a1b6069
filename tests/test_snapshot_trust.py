"""What a restore trusts on disk: verified data, our own files, authenticated markers (issue 36).

Each test goes through the public API (a wrapped call's ``restore``/``commit``)
the way a user or a hostile local user would: changing a persisted file,
planting a directory, a pickle, a marker. A wrapped call in this process is
a one-rank job; a second call starts with empty memory, so its ``restore``
reads only what is on disk, like a fresh process.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import inprocess
from inprocess.exception import RestartAbort
from inprocess.initialize import RetryController

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.timeout(240)

#: the uid and gid of the hostile local user (``nobody``)
STRANGER = 65534
N = 1000


def wrapped(snapshot_dir: Path, persist_every: int | None = 1):
    """A wrapped training function over ``{"w": N floats, "data": {...}}``: restores,
    then runs (and commits) up to ``steps`` steps; step ``s`` leaves ``w == s``.

    Returns ``(restored step, w after restore, the restore record)``; at most two
    iterations (a restore that keeps failing ends the call).
    """
    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    @fast_wrapper(
        snapshot_dir=str(snapshot_dir),
        persist_every=persist_every,
        initialize=RetryController(max_iterations=2),
    )
    def train(steps: int, call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        try:
            state = {"w": torch.zeros(N), "data": {"step": 0}}
            start = call_wrapper.restore(state)
            restored = state["w"].clone()
            for step in range(start, steps):
                state["w"] += 1
                state["data"]["step"] = step + 1
                call_wrapper.commit(state, step + 1)
                time.sleep(0.02)  # the disk writer's thread gets to a step before the last
            return start, restored, dict(call_wrapper.last_restore)
        finally:
            dist.destroy_process_group()

    return train


def data_file(snapshot_dir: Path, step: int) -> Path:
    (path,) = (snapshot_dir / f"step-{step:08d}" / "shard-0").glob("*.distcp")
    return path


def change_a_float(path: Path, old: float, new: float) -> None:
    """Changes one float of ``path`` from ``old`` to ``new`` in place (a bit rot, an edit)."""
    raw = bytearray(path.read_bytes())
    run = struct.pack("<f", old) * N
    at = raw.find(run)
    assert at >= 0, f"no tensor of {old} in {path}"
    raw[at + 4 * 500 : at + 4 * 501] = struct.pack("<f", new)
    path.write_bytes(bytes(raw))


def test_a_snapshot_changed_on_disk_falls_back_to_the_newest_intact_step_or_fails(
    single_rank, tmp_path, caplog
):
    snap = tmp_path / "snap"
    train = wrapped(snap)
    start, _w, _record = train(5)
    assert start == 0
    # the call ended with step 5 on disk, and one older step (the newest one the
    # writer got to: a disk behind skips due steps)
    steps = sorted(int(p.name[len("step-") :]) for p in snap.glob("step-*"))
    assert len(steps) == 2 and steps[1] == 5, steps
    older = steps[0]

    change_a_float(data_file(snap, 5), 5.0, -123456.0)
    # a fresh call finds only the disk: step 5 fails its checksums, the older step is intact
    caplog.set_level("WARNING", logger="inprocess.snapshot")
    start, w, record = wrapped(snap)(older)  # (trains nothing: step 5 is not rewritten)
    assert start == older and torch.equal(w, torch.full((N,), float(older))), (start, w[500])
    assert record["step"] == older and record["sources"]["disk"] == 1 and record["verified"]
    assert [(r["rank"], r["step"], r["shard"]) for r in record["rejected"]] == [(0, 5, 0)]
    assert "'w'" in record["rejected"][0]["reason"], record
    assert any(
        "step-00000005" in r.getMessage() and "'w'" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]

    # every step on disk damaged: one clear error naming the directory and the steps
    change_a_float(data_file(snap, older), float(older), 7.0)
    with pytest.raises(RestartAbort) as info:
        wrapped(snap)(older)
    assert type(info.value).__name__ == "SnapshotCorrupt", repr(info.value)
    text = str(info.value)
    assert str(snap) in text and "step 5" in text and f"step {older}" in text, text
    assert os.stat(snap).st_mode & 0o777 == 0o700  # created private


def _stranger(script: str, stdin: bytes = b"") -> None:
    """Runs ``script`` (sh) as the hostile local user."""
    subprocess.run(
        [
            "setpriv", "--reuid", str(STRANGER), "--regid", str(STRANGER), "--clear-groups",
            "sh", "-ec", script,
        ],
        input=stdin,
        check=True,
        timeout=30,
    )


class _Payload:
    """Unpickling it runs a command: what a planted pickle does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _planted_marker(command: str, step: int) -> bytes:
    blob = base64.b64encode(pickle_dumps(_Payload(command))).decode()
    return json.dumps(
        {
            "step": step, "shard": 0, "world_size": 1, "replicated": True, "bytes": 0,
            "time": 0, "checksums": {"w": 0}, "skeleton": {"w": blob},
        }
    ).encode()


def pickle_dumps(obj) -> bytes:
    import pickle

    return pickle.dumps(obj)


@pytest.fixture
def shared_tmp():
    """A sticky directory every local user may create entries in (like ``/tmp``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another local user (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv, to act as another local user")
    path = Path(tempfile.mkdtemp(prefix="inprocess-trust-"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_snapshot_dir_planted_by_another_user_is_refused_before_anything_is_read(
    single_rank, shared_tmp
):
    snap = shared_tmp / "snap"
    pwned = shared_tmp / "pwned"
    step = snap / "step-99999999"
    # the stranger creates the directory first, open to all, with a pickle as a marker
    _stranger(
        f"mkdir -m 777 {snap} {step} && cat > {step}/shard-0.done.json",
        _planted_marker(f"touch {pwned}", 99999999),
    )
    with pytest.raises(RestartAbort) as info:
        wrapped(snap)(3)
    assert not pwned.exists(), "the planted pickle ran as the job's user"
    assert type(info.value).__name__ == "SnapshotTrustError", repr(info.value)
    text = str(info.value)
    assert str(snap) in text and f"owned by uid {STRANGER}" in text, text


def test_what_another_user_could_change_below_our_snapshot_dir_is_refused(
    single_rank, shared_tmp
):
    # our own directory, persisted by a first call; then made writable by others
    # (a careless chmod), and the stranger swaps DCP's .metadata (a pickle) for its own
    snap = shared_tmp / "snap"
    pwned = shared_tmp / "pwned"
    assert wrapped(snap)(2)[0] == 0
    step = snap / "step-00000002"
    os.chmod(step / "shard-0", 0o777)
    os.chmod(step, 0o755)
    os.chmod(snap, 0o755)
    payload = pickle_dumps(_Payload(f"touch {pwned}"))
    _stranger(f"rm -f {step}/shard-0/.metadata && cat > {step}/shard-0/.metadata", payload)
    with pytest.raises(RestartAbort) as info:
        wrapped(snap)(2)
    assert not pwned.exists(), "the planted .metadata ran as the job's user"
    assert type(info.value).__name__ == "SnapshotTrustError", repr(info.value)
    text = str(info.value)
    assert f"{step}/shard-0" in text and "writable by group or others" in text, text

    # a symlink below it, even to our own files, is refused too
    os.chmod(step / "shard-0", 0o700)
    os.unlink(step / "shard-0" / ".metadata")
    os.symlink("/etc/passwd", step / "shard-0" / ".metadata")
    with pytest.raises(RestartAbort) as info:
        wrapped(snap)(2)
    assert "symlink" in str(info.value) and ".metadata" in str(info.value), str(info.value)


def test_a_marker_this_job_did_not_write_is_not_trusted(single_rank, tmp_path, monkeypatch):
    """Files of our own user that our writer did not write (a forged marker, markers under
    another key): a marker whose MAC does not verify is never unpickled, nor its step
    loaded; a later launch with another job secret restores what this one wrote."""
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "the-first-jobs-secret-0123456789abcdef")
    snap = tmp_path / "snap"
    pwned = tmp_path / "pwned"
    assert wrapped(snap)(3)[0] == 0
    # a forged marker of a newer step (no MAC, a pickle for a skeleton)
    forged = snap / "step-00000009"
    shutil.copytree(snap / "step-00000003", forged)
    (forged / "shard-0.done.json").write_bytes(_planted_marker(f"touch {pwned}", 9))
    start, w, record = wrapped(snap)(3)
    assert not pwned.exists(), "a forged marker was unpickled"
    assert start == 3 and torch.equal(w, torch.full((N,), 3.0))
    assert [(r["step"], r["shard"]) for r in record["rejected"]] == [(9, 0)], record

    # a later launch (another job secret) restores them: the key lives with them
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "another-jobs-secret-0123456789abcdef0")
    start, w, record = wrapped(snap)(3)
    assert start == 3 and torch.equal(w, torch.full((N,), 3.0)), record
    # markers MAC'd under another key (the key file replaced): not ours, nothing loaded
    key = snap / ".marker-key"
    key.unlink()
    key.write_text("0" * 64)
    key.chmod(0o600)
    with pytest.raises(RestartAbort) as info:
        wrapped(snap)(3)
    assert type(info.value).__name__ == "SnapshotCorrupt", repr(info.value)
    assert ".marker-key" in str(info.value), str(info.value)
    assert not pwned.exists()



@pytest.mark.slow
@pytest.mark.timeout(660)
def test_one_ranks_damaged_shard_makes_every_rank_fall_back_together(tmp_path):
    """Per-rank state, two ranks reading their own shards from disk: rank 1's newest
    shard was changed on disk, rank 0's is intact; both restore the older step."""
    import torch.distributed.checkpoint as dcp
    from launcher import WORKERS, run_job
    from test_snapshot_e2e import check_final, restores, spec

    sys.path.insert(0, str(WORKERS))
    import snapshot_model as sm

    snap = tmp_path / "snap"
    local = lambda rank: rank + 1  # noqa: E731
    settings = dict(snapshot_dir=str(snap), persist_every=2, replicated=False)
    first = run_job(
        "snapshot_train.py", 2, tmp_path / "first", spec(tmp_path / "first", steps=6, **settings),
        timeout=300,
    )  # fmt: skip
    check_final(first, [0, 1], 6, local)
    steps = sorted(p.name for p in snap.glob("step-*"))
    assert len(steps) == 2 and steps[1] == "step-00000006", steps
    older = int(steps[0][len("step-") :])
    # one weight of rank 1's shard at step 6, changed in its data file
    shard = snap / "step-00000006" / "shard-1"
    model, _opt = sm.build()
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=str(shard), no_dist=True)
    (data,) = shard.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(target["model"]["weight"].numpy().tobytes())
    assert at >= 0
    raw[at : at + 8] = struct.pack("<d", -123456.0)
    data.write_bytes(bytes(raw))

    (tmp_path / "second").mkdir()
    second = run_job(
        "snapshot_train.py", 2, tmp_path / "second", spec(tmp_path / "second", steps=8, **settings),
        timeout=300,
    )  # fmt: skip
    check_final(second, [0, 1], 8, local)
    record = restores(tmp_path / "second")[0]
    assert record["step"] == older and record["sources"]["disk"] == 2 and record["verified"]
    assert [(r["rank"], r["step"], r["shard"]) for r in record["rejected"]] == [(1, 6, 1)]
    assert "'model'" in record["rejected"][0]["reason"], record
    # the steps the job wrote since are whole (the damaged newer step did not make
    # the writers remove them)
    shards = {"shard-0.done.json", "shard-1.done.json"}
    assert {p.name for p in (snap / "step-00000008").glob("*.json")} == shards


def test_a_fifo_in_place_of_the_marker_key_is_refused_without_blocking(single_rank, tmp_path):
    """Opening a FIFO for reading blocks until someone opens it for writing: the key
    file is opened without blocking and refused by name as not a regular file."""
    import threading

    snap = tmp_path / "snap"
    assert wrapped(snap)(2)[0] == 0
    key = snap / ".marker-key"
    key.unlink()
    os.mkfifo(key, 0o600)
    blocked, done = threading.Event(), threading.Event()

    def unblock() -> None:
        # A restore still in open() after a while is let go on by a writer opening the
        # FIFO (that open succeeds only while a reader has it open), and noted.
        if done.wait(20):
            return
        while not done.wait(0.2):
            try:
                fd = os.open(key, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader has it open
                continue
            blocked.set()
            os.close(fd)
            return

    watcher = threading.Thread(target=unblock, name="fifo-watcher")
    watcher.start()
    try:
        with pytest.raises(RestartAbort) as info:
            wrapped(snap)(2)
    finally:
        done.set()
        watcher.join(30)
    assert not blocked.is_set(), "restore blocked on the FIFO until a writer opened it"
    assert type(info.value).__name__ == "SnapshotTrustError", repr(info.value)
    text = str(info.value)
    assert ".marker-key" in text and "regular file" in text, text
