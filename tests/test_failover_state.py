"""Tests of the durable failover state: format, atomic saves, strict loads, ownership."""

from __future__ import annotations

import json
import os
import stat

import pytest

from inprocess.failover import policy as P
from inprocess.failover import state as S
from inprocess.failover.spec import JobSpec
from inprocess.failover.state import (
    JobState,
    Stage,
    StateError,
    StateExistsError,
    StateFileError,
    StateStore,
    WorkerStatus,
    dumps_state,
    load_state,
    loads_state,
    save_state,
)


def make_state(tmp_path, job_id: str = "job", **kw) -> JobState:
    spec = JobSpec(
        job_id=job_id,
        entrypoint=["train.py", "--lr", "0.1"],
        nnodes=2,
        nproc_per_node=2,
        spare_nodes=1,
        state_dir=str(tmp_path),
        **kw,
    )
    return P.new_job_state(spec, now=1.0)


def busy_state(tmp_path) -> JobState:
    """A state that uses every field: started, failed, relaunching, with a store."""
    state = make_state(tmp_path, per_node_max_failures=1)
    state = P.set_wrapper_managed(state, True, now=2.0)
    state, _ = P.start_job(state, now=3.0)
    for w in range(4):
        state = P.worker_started(state, w, pid=100 + w, start_time=1234.5 + w, now=4.0)
    state, _ = P.handle_event(state, P.WorkerReported(1, 0, "exception"), now=5.0)
    state = P.worker_started(state, 1, pid=200, start_time=1300.25, now=6.0)
    state, actions = P.handle_event(state, P.WorkerExited(0, 0, None, 9), now=7.0)
    assert isinstance(actions[0], P.RelaunchNode)
    state.store = {"host": "127.0.0.1", "port": 29500, "pid": 42, "namespace": "job/0"}
    return state


def test_round_trip_preserves_everything(tmp_path):
    state = busy_state(tmp_path)
    path = tmp_path / "state.json"
    save_state(path, state)
    loaded = load_state(path)
    assert loaded == state
    assert loaded.workers[1].status is WorkerStatus.STOPPING
    assert loaded.relaunching_nodes == {0}
    assert loaded.removed_slots == [0] and loaded.node_slots == {0: 2, 1: 1}
    assert loaded.handled_failures == {"1:0", "0:0"}
    assert isinstance(next(iter(loaded.workers)), int)
    assert loaded.spec.entrypoint == ("train.py", "--lr", "0.1")
    # saving what was loaded gives the same bytes
    text = path.read_bytes()
    save_state(path, loaded)
    assert path.read_bytes() == text


def test_file_is_versioned_readable_json(tmp_path):
    path = tmp_path / "state.json"
    save_state(path, busy_state(tmp_path))
    text = path.read_text()
    data = json.loads(text)
    assert data["format"] == "inprocess.failover.state" and data["version"] == 1
    assert text.startswith('{\n  "')  # indented
    assert text.endswith("}\n")
    assert list(data) == sorted(data)  # sorted keys
    assert data["stage"] == "RUNNING"
    assert data["workers"]["1"]["status"] == "stopping"
    assert data["handled_failures"] == ["0:0", "1:0"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_save_is_fsynced_and_renamed(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1]
    )
    save_state(tmp_path / "state.json", make_state(tmp_path))
    assert calls == ["fsync", "replace", "fsync"]  # file, rename, directory
    assert os.listdir(tmp_path) == ["state.json"]


def test_failed_replace_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    old = make_state(tmp_path)
    save_state(path, old)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        save_state(path, busy_state(tmp_path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]  # the temp file was removed
    assert load_state(path) == old


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    save_state(path, make_state(tmp_path))
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("no space left")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="no space"):
        save_state(path, busy_state(tmp_path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


def test_unserializable_state_never_touches_the_file(tmp_path):
    path = tmp_path / "state.json"
    save_state(path, make_state(tmp_path))
    before = path.read_bytes()
    bad = make_state(tmp_path)
    bad.store = {"port": float("nan")}
    with pytest.raises(ValueError):
        save_state(path, bad)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


def test_stray_temp_file_from_a_crash_is_harmless(tmp_path):
    path = tmp_path / "state.json"
    state = make_state(tmp_path)
    save_state(path, state)
    stray = tmp_path / ".state.json.abc123.tmp"
    stray.write_text('{"format": "inprocess.failover.state", "vers')  # half-written
    assert load_state(path) == state
    newer = P.set_wrapper_managed(state, False, now=9.0)
    save_state(path, newer)
    assert load_state(path) == newer
    assert stray.exists()  # left alone: another writer's temp file is not ours to delete


# -- strict loading -------------------------------------------------------------


def write_json(tmp_path, data) -> tuple[str, bytes]:
    path = tmp_path / "state.json"
    text = data if isinstance(data, str) else json.dumps(data, indent=2)
    path.write_text(text)
    return str(path), path.read_bytes()


def good_dict(tmp_path):
    return json.loads(dumps_state(busy_state(tmp_path)))


def mutate(data, dotted: str, value=None, delete: bool = False):
    *parents, last = dotted.split(".")
    target = data
    for p in parents:
        target = target[p]
    if delete:
        del target[last]
    else:
        target[last] = value
    return data


BAD_FILES = [
    ("not json", "{nope", "not valid JSON"),
    ("empty file", "", "not valid JSON"),
    ("NaN", None, "not valid JSON"),
    ("list at top", [], "top level"),
    ("wrong format", ("format", "something.else"), "'format'"),
    ("no format", ("format", None, True), "'format' is missing"),
    ("newer version", ("version", 2), "'version' is 2"),
    ("float version", ("version", 1.0), "'version'"),
    ("bool version", ("version", True), "'version'"),
    ("missing stage", ("stage", None, True), "missing field stage"),
    ("missing workers", ("workers", None, True), "missing field workers"),
    (
        "missing worker field",
        ("workers.2.incarnation", None, True),
        "missing field workers.2.incarnation",
    ),
    ("bad stage", ("stage", "PAUSED"), "field stage must be one of"),
    ("bad status", ("workers.0.status", "zombie"), "field workers.0.status must be one of"),
    ("string counter", ("job_restarts", "1"), "field job_restarts must be an integer"),
    ("negative counter", ("node_relaunches", -1), "field node_relaunches must be >= 0"),
    ("bool counter", ("generation", True), "field generation must be an integer"),
    ("bad key", ("node_slots", {"zero": 0}), "expected a non-negative integer"),
    ("padded key", ("node_slots", {"01": 0}), "expected a non-negative integer"),
    ("bad failure key", ("handled_failures", ["1-0"]), "worker:incarnation"),
    ("bad managed", ("wrapper_managed", "yes"), "field wrapper_managed"),
    ("bad store", ("store", []), "field store must be a JSON object"),
    ("bad spec", ("spec.nnodes", 0), "field spec is invalid"),
    ("spec missing field", ("spec.max_restarts", None, True), "missing field(s) max_restarts"),
    ("job id mismatch", ("job_id", "other"), "differs from spec.job_id"),
    ("unknown field", ("surprise", 1), "unknown field(s) surprise"),
    ("unknown worker field", ("workers.0.colour", "red"), "unknown key(s) colour"),
    ("bad event", ("events", [{"kind": "x"}]), "missing field events[0].time"),
    (
        "bad start time",
        ("workers.0.pid_start_time", "now"),
        "field workers.0.pid_start_time must be a number",
    ),
]


@pytest.mark.parametrize(("name", "change", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_raise_and_are_left_unchanged(tmp_path, name, change, message):
    if isinstance(change, str):
        path, before = write_json(tmp_path, change)
    elif change is None:
        path, before = write_json(tmp_path, '{"format": NaN}')
    elif isinstance(change, list):
        path, before = write_json(tmp_path, change)
    else:
        path, before = write_json(tmp_path, mutate(good_dict(tmp_path), *change))
    with pytest.raises(StateFileError) as info:
        load_state(path)
    assert message in str(info.value)
    assert path in str(info.value)  # names the file
    assert (tmp_path / "state.json").read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


def test_non_utf8_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(StateFileError, match="UTF-8"):
        load_state(path)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path / "state.json")


def test_loads_state_names_the_source():
    with pytest.raises(StateFileError, match="<string>"):
        loads_state("[]")


# -- StateStore ---------------------------------------------------------------------


def test_store_create_load_save(tmp_path):
    store = StateStore(tmp_path / "new-dir")
    assert store.path == str(tmp_path / "new-dir" / "state.json")
    assert not store.exists() and store.owner is None
    state = make_state(tmp_path)
    store.create(state)
    assert store.exists() and store.owner == "job"
    newer, _ = P.start_job(state, now=2.0)
    store.save(newer)
    assert StateStore(tmp_path / "new-dir").load() == newer


def test_create_refuses_an_existing_state(tmp_path):
    store = StateStore(tmp_path)
    old = make_state(tmp_path, job_id="old-job")
    old, _ = P.start_job(old, now=2.0)
    store.create(old)
    before = (tmp_path / "state.json").read_bytes()
    with pytest.raises(StateExistsError) as info:
        StateStore(tmp_path).create(make_state(tmp_path, job_id="new-job"))
    message = str(info.value)
    assert "'old-job'" in message and "READY" in message and "choose another state dir" in message
    assert (tmp_path / "state.json").read_bytes() == before
    # the same job id does not help: a new job never inherits a state
    with pytest.raises(StateExistsError):
        StateStore(tmp_path).create(make_state(tmp_path, job_id="old-job"))
    assert (tmp_path / "state.json").read_bytes() == before


def test_create_refuses_a_corrupt_state_and_keeps_it(tmp_path):
    _, before = write_json(tmp_path, "{garbage")
    with pytest.raises(StateFileError, match="cannot be loaded") as info:
        StateStore(tmp_path).create(make_state(tmp_path))
    assert "left untouched" in str(info.value)
    assert (tmp_path / "state.json").read_bytes() == before


def test_create_without_hard_links_still_refuses(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError("links not supported")

    monkeypatch.setattr(os, "link", no_link)
    store = StateStore(tmp_path)
    store.create(make_state(tmp_path))
    assert store.load() == make_state(tmp_path)
    with pytest.raises(StateExistsError):
        StateStore(tmp_path).create(make_state(tmp_path, job_id="x"))
    assert os.listdir(tmp_path) == ["state.json"]


def test_save_requires_create_or_load(tmp_path):
    write_json(tmp_path, {"format": "inprocess.failover.state", "version": 99})
    before = (tmp_path / "state.json").read_bytes()
    store = StateStore(tmp_path)
    with pytest.raises(StateError, match="neither created nor loaded"):
        store.save(make_state(tmp_path))
    with pytest.raises(StateFileError, match="version"):
        store.load()
    with pytest.raises(StateError, match="neither created nor loaded"):
        store.save(make_state(tmp_path))
    assert (tmp_path / "state.json").read_bytes() == before


def test_save_refuses_another_jobs_state(tmp_path):
    store = StateStore(tmp_path)
    store.create(make_state(tmp_path, job_id="a"))
    with pytest.raises(StateError, match="belongs to job 'a'"):
        store.save(make_state(tmp_path, job_id="b"))
    assert store.load().job_id == "a"


def test_owner_may_overwrite_its_own_damaged_file(tmp_path):
    store = StateStore(tmp_path)
    state = make_state(tmp_path)
    store.create(state)
    (tmp_path / "state.json").write_text("damaged")
    store.save(state)
    assert store.load() == state


# -- JobState helpers -----------------------------------------------------------------


def test_copy_is_independent(tmp_path):
    state = busy_state(tmp_path)
    copy = state.copy()
    assert copy == state and copy.spec is state.spec
    copy.workers[0].incarnation = 99
    copy.handled_failures.add("3:0")
    copy.store["port"] = 1
    copy.events.append({"time": None, "kind": "x", "message": "y"})
    assert state.workers[0].incarnation != 99
    assert "3:0" not in state.handled_failures
    assert state.store["port"] == 29500
    assert state.events[-1]["kind"] != "x"


def test_log_event_is_bounded(tmp_path):
    state = make_state(tmp_path)
    for i in range(S.MAX_EVENTS + 10):
        state.log_event("tick", f"event {i}", float(i))
    assert len(state.events) == S.MAX_EVENTS
    assert state.events[0]["message"] == "event 10"
    assert state.events[-1] == {
        "time": float(S.MAX_EVENTS + 9),
        "kind": "tick",
        "message": f"event {S.MAX_EVENTS + 9}",
    }


def test_stage_and_status_values():
    assert [s.value for s in Stage] == ["INIT", "READY", "RUNNING", "STOPPING", "STOPPED"]
    assert {s.value for s in WorkerStatus} == {
        "pending",
        "running",
        "stopping",
        "succeeded",
        "failed",
        "aborted",
    }
    assert S.failure_key(3, 1) == "3:1"


def test_save_cost_is_small(tmp_path):
    """Saving on every change must stay cheap: a 64-worker state is a few tens of KiB."""
    spec = JobSpec(
        job_id="big", entrypoint=["t.py"], nnodes=8, nproc_per_node=8, state_dir=str(tmp_path)
    )
    state = P.new_job_state(spec, now=0.0)
    for i in range(S.MAX_EVENTS):
        state.log_event("tick", "x" * 60, float(i))
    assert len(dumps_state(state)) < 100_000


def test_failure_key_codec():
    key = S.FailureKey(3, 12)
    assert key.encode() == S.failure_key(3, 12) == "3:12"
    assert S.FailureKey.parse("3:12") == key
    for bad in ("3", "3:1:2", "-1:0", "a:0", "1:", "³:0"):
        with pytest.raises(ValueError, match="worker:incarnation"):
            S.FailureKey.parse(bad)
