"""Tests of the job spec: validation with clear errors, placement helpers, round trip."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from inprocess.failover.spec import JobSpec, SpecError

BASE = dict(
    job_id="job-1.a_b",
    entrypoint=["train.py", "--epochs", "3"],
    nnodes=2,
    nproc_per_node=4,
    state_dir="/var/tmp/inprocess/job-1",
)


def make(**kw) -> JobSpec:
    return JobSpec(**{**BASE, **kw})


def test_defaults():
    spec = make()
    assert spec.spare_nodes == 0
    assert spec.max_restarts == 3
    assert spec.per_node_max_failures == 3
    assert spec.job_max_restarts == 3
    assert spec.node_max_relaunches == 1
    assert spec.master_addr == "127.0.0.1"
    assert spec.monitor_interval == 0.1


def test_normalization():
    spec = make(entrypoint=["a.py", "x"], state_dir=pathlib.Path("/abs/dir"), monitor_interval=2)
    assert spec.entrypoint == ("a.py", "x")
    assert spec.state_dir == "/abs/dir"
    assert isinstance(spec.monitor_interval, float) and spec.monitor_interval == 2.0
    assert hash(spec) == hash(
        make(entrypoint=("a.py", "x"), state_dir="/abs/dir", monitor_interval=2.0)
    )


def test_frozen_and_keyword_only():
    spec = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nnodes = 3
    with pytest.raises(TypeError):
        JobSpec("job", ["t.py"], 1, 1, "/tmp")  # positional arguments are refused


INVALID = [
    ("job_id", "", "JobSpec.job_id must be a non-empty string of letters, digits"),
    ("job_id", "has space", "JobSpec.job_id"),
    ("job_id", "a/b", "JobSpec.job_id"),
    ("job_id", "..", "JobSpec.job_id must not be '.' or '..'"),
    ("job_id", 7, "JobSpec.job_id"),
    ("entrypoint", [], "JobSpec.entrypoint must not be empty"),
    ("entrypoint", "train.py", "JobSpec.entrypoint must be a list of strings"),
    ("entrypoint", None, "JobSpec.entrypoint must be a list of strings"),
    ("entrypoint", ["t.py", 3], "JobSpec.entrypoint[1] must be a string"),
    ("entrypoint", [""], "JobSpec.entrypoint[0] (the script path) must not be empty"),
    ("nnodes", 0, "JobSpec.nnodes must be an integer in 1..100000, got 0"),
    ("nnodes", "2", "JobSpec.nnodes must be an integer in 1..100000, got '2' (str)"),
    ("nnodes", True, "JobSpec.nnodes must be an integer in 1..100000, got True (bool)"),
    ("nnodes", 2.0, "JobSpec.nnodes must be an integer in 1..100000"),
    ("nproc_per_node", 0, "JobSpec.nproc_per_node must be an integer in 1..1024"),
    ("spare_nodes", -1, "JobSpec.spare_nodes must be an integer in 0..100000, got -1"),
    ("max_restarts", -1, "JobSpec.max_restarts must be an integer in 0..1000000"),
    ("per_node_max_failures", 0, "JobSpec.per_node_max_failures must be an integer in 1..1000000"),
    ("job_max_restarts", -2, "JobSpec.job_max_restarts must be an integer in 0..1000000"),
    ("node_max_relaunches", None, "JobSpec.node_max_relaunches must be an integer in 0..1000000"),
    ("state_dir", "relative/dir", "JobSpec.state_dir must be an absolute path"),
    ("state_dir", "", "JobSpec.state_dir must be an absolute path"),
    ("state_dir", None, "JobSpec.state_dir must be an absolute path"),
    ("master_addr", "", "JobSpec.master_addr must be a non-empty host name"),
    ("master_addr", "a b", "JobSpec.master_addr"),
    ("master_addr", 127, "JobSpec.master_addr"),
    ("monitor_interval", 0, "JobSpec.monitor_interval must be a number of seconds in 0.001..60"),
    ("monitor_interval", -1.0, "JobSpec.monitor_interval"),
    ("monitor_interval", float("inf"), "JobSpec.monitor_interval"),
    ("monitor_interval", float("nan"), "JobSpec.monitor_interval"),
    ("monitor_interval", "0.1", "JobSpec.monitor_interval"),
    ("monitor_interval", True, "JobSpec.monitor_interval"),
    ("run_as", "binary", "JobSpec.run_as must be one of script, module, program"),
    ("master_port", 70000, "JobSpec.master_port must be an integer in 0..65535"),
    ("log_dir", "logs", "JobSpec.log_dir must be an absolute path or None"),
    ("redirects", "5", "JobSpec.redirects must be 0 (none), 1 (stdout), 2 (stderr) or 3"),
    ("redirects", "3", "JobSpec.redirects writes log files: it needs JobSpec.log_dir"),
    ("tee", "0:1,x", "JobSpec.tee must be 0 (none)"),
    ("local_ranks_filter", [], "JobSpec.local_ranks_filter must be None or a non-empty list"),
    ("local_ranks_filter", [-1], "JobSpec.local_ranks_filter"),
    ("standby", -1, "JobSpec.standby must be an integer in 0..64, got -1"),
    # the upper bounds (no fork storm, no overflow, no name longer than a file name)
    ("standby", 100000, "JobSpec.standby must be an integer in 0..64, got 100000"),
    ("spare_nodes", 10**9, "JobSpec.spare_nodes must be an integer in 0..100000"),
    ("nnodes", 10**9, "JobSpec.nnodes must be an integer in 1..100000"),
    ("nproc_per_node", 10**5, "JobSpec.nproc_per_node must be an integer in 1..1024"),
    ("max_restarts", 10**30, "JobSpec.max_restarts must be an integer in 0..1000000"),
    ("monitor_interval", 1e308, "JobSpec.monitor_interval must be a number of seconds in"),
    ("monitor_interval", 1e-5, "JobSpec.monitor_interval must be a number of seconds in"),
    ("job_id", "j" * 129, "JobSpec.job_id must be at most 128 characters, got 129"),
    ("join_timeout", -1, "JobSpec.join_timeout must be a number of seconds in 0..86400"),
    ("join_timeout", "60", "JobSpec.join_timeout must be a number of seconds"),
    ("standby_join_timeout", float("inf"), "JobSpec.standby_join_timeout must be a number"),
]


@pytest.mark.parametrize(("field", "value", "message"), INVALID)
def test_invalid_fields_raise_clear_errors(field, value, message):
    with pytest.raises(SpecError) as info:
        make(**{field: value})
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_field_is_validated():
    validated = {field for field, _, _ in INVALID}
    assert validated == {f.name for f in dataclasses.fields(JobSpec)}


def test_worker_command_and_streams():
    spec = make(nnodes=2, nproc_per_node=2, entrypoint=["pkg.mod", "a"], run_as="module",
                log_dir="/logs", redirects="0:1", tee="1:3", local_ranks_filter=[1])  # fmt: skip
    assert spec.command("py") == ("py", "-m", "pkg.mod", "a")
    assert make(entrypoint=["prog", "a"], run_as="program").command("py") == ("prog", "a")
    assert make(entrypoint=["t.py"]).command("py") == ("py", "t.py")
    # (redirect, tee, shown) by local rank: worker 2 is local rank 0 of node 1
    assert [spec.streams_of(w) for w in range(4)] == [
        (1, 0, False), (0, 3, True), (1, 0, False), (0, 3, True)
    ]  # fmt: skip
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_placement_helpers():
    spec = make(nnodes=3, nproc_per_node=2, spare_nodes=1)
    assert spec.world_size == 6
    assert spec.num_slots == 4
    assert [spec.node_of(w) for w in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [spec.local_rank_of(w) for w in range(6)] == [0, 1, 0, 1, 0, 1]
    assert list(spec.workers_of(1)) == [2, 3]
    assert [w for n in range(3) for w in spec.workers_of(n)] == list(range(6))


@pytest.mark.parametrize("worker", [-1, 6, True, "1"])
def test_node_of_rejects_bad_workers(worker):
    spec = make(nnodes=3, nproc_per_node=2)
    with pytest.raises(ValueError, match=r"worker must be an integer in 0\.\.5"):
        spec.node_of(worker)
    with pytest.raises(ValueError, match="worker must be"):
        spec.local_rank_of(worker)


@pytest.mark.parametrize("node", [-1, 3, None])
def test_workers_of_rejects_bad_nodes(node):
    with pytest.raises(ValueError, match=r"node must be an integer in 0\.\.2"):
        make(nnodes=3).workers_of(node)


def test_round_trip():
    spec = make(spare_nodes=2, max_restarts=0, master_addr="10.0.0.1", monitor_interval=0.5)
    data = spec.to_dict()
    assert data["entrypoint"] == ["train.py", "--epochs", "3"]
    assert JobSpec.from_dict(json.loads(json.dumps(data))) == spec
    assert set(data) == {f.name for f in dataclasses.fields(JobSpec)}


def test_from_dict_rejects_unknown_fields():
    data = {**make().to_dict(), "max_restart": 3}
    with pytest.raises(SpecError, match=r"unknown field.*max_restart; allowed fields: job_id"):
        JobSpec.from_dict(data)


def test_from_dict_rejects_missing_fields():
    data = make().to_dict()
    del data["max_restarts"]
    del data["nnodes"]
    with pytest.raises(SpecError, match=r"missing field\(s\) nnodes, max_restarts"):
        JobSpec.from_dict(data)


def test_from_dict_validates_values_and_type():
    with pytest.raises(SpecError, match=r"JobSpec\.nnodes"):
        JobSpec.from_dict({**make().to_dict(), "nnodes": -3})
    with pytest.raises(SpecError, match="must be a mapping"):
        JobSpec.from_dict(["job"])
