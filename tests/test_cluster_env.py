"""Launch parameters from flags and the environment: Slurm host lists, the
multi-machine parameters of ``inprocess-run`` (flags, torchrun's ``PET_*``
variables, a Kubernetes pod's, Slurm's), and the rank variables of a Wrapper
script that srun started directly. Pure functions on given mappings; the
Wrapper's part on a patched ``os.environ``."""

from __future__ import annotations

import os
import re
import socket

import pytest

import inprocess
from inprocess.failover.cluster_env import (
    DEFAULT_PORT,
    MultiNodeArgs,
    nnodes_range,
    resolve,
    torchrun_env,
)
from inprocess.slurm_env import (
    COORDINATOR_PORT_BASE,
    MASTER_PORT_BASE,
    PORT_SPAN,
    apply_slurm_task_env,
    coordinator_port,
    first_host,
    master_port,
    parse_hostlist,
    parse_tasks_per_node,
    slurm_task_env,
)

pytestmark = pytest.mark.timeout(60)

# --- Slurm host lists ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-4]", ["n1", "n2", "n3", "n4"]),
        ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("n[1-2],login1,x[03-04]", ["n1", "n2", "login1", "x03", "x04"]),
        ("rack[1-2]n[5]", ["rack1n5", "rack2n5"]),
    ],
)
def test_parse_hostlist(text, hosts):
    assert parse_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "an empty host name"),
        ("a,,b", "an empty host name"),
        ("n[1-", r"'\[' not closed"),
        ("n]", r"'\]' without '\['"),
        ("n[[1]]", r"nested '\['"),
        ("n[a]", "range 'a'"),
        ("n[]", "range ''"),
        ("n[3-1]", "runs backwards"),
        ("n 1", "character ' '"),
        ("a[1-1000]b[1-1000]c[1-2]", "more than 1000000 hosts"),
    ],
)
def test_parse_hostlist_names_the_variable_on_bad_input(text, why):
    with pytest.raises(
        ValueError, match=rf"^SLURM_JOB_NODELIST={re.escape(repr(text))} .*{why}.*n\[1-4\]"
    ):
        parse_hostlist(text, "SLURM_JOB_NODELIST")


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    for bad in ("", "0", "2(x0)", "2(3)", "x"):
        with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE=.*2\(x3\),1"):
            parse_tasks_per_node(bad)


def test_derived_ports_are_unprivileged_and_never_collide():
    """A coordinator's port never meets any job's MASTER_PORT, +1 or +2 (the usage
    guide's stores), and both stay below Linux's ephemeral range."""
    coordinators = {coordinator_port(job) for job in range(PORT_SPAN)}
    masters = {master_port(job) + k for job in range(PORT_SPAN) for k in range(3)}
    assert not coordinators & masters
    assert 1024 < min(coordinators) and max(masters) < 32768
    assert coordinator_port("4242") == COORDINATOR_PORT_BASE + 4242
    assert master_port(4242 + PORT_SPAN) == MASTER_PORT_BASE + 4242
    with pytest.raises(ValueError, match="SLURM_JOB_ID='12_3' is not a Slurm job id"):
        coordinator_port("12_3")


# --- inprocess-run: the parameters of a job of several machines ---------------------

#: a task of `srun -N4 --ntasks-per-node=1 inprocess-run ...` on the third node
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_JOB_NODELIST": "gpu-[07-10]",
    "SLURM_STEP_NODELIST": "gpu-[07-10]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURMD_NODENAME": "gpu-09",
}

#: a pod of a Kubernetes PyTorchJob of 2 pods (the second)
POD = {
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "8",
    "PET_MASTER_ADDR": "train-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "train-master-0",
    "MASTER_PORT": "23456",
    "RANK": "1",
}


def test_nnodes_range():
    assert nnodes_range("4") == (4, 4)
    assert nnodes_range("4:5") == (4, 5)
    assert nnodes_range(3) == (3, 3)
    for bad in ("0", "5:4", "4:", ":4", "a", "1:2:3", "-1", "100001"):
        with pytest.raises(ValueError, match=r"--nnodes=.*want N or MIN:MAX .*hot spares"):
            nnodes_range(bad)


def test_one_machine_resolves_to_none():
    assert resolve({}, {}) is None
    assert resolve({"nnodes": "1"}, {}) is None
    assert resolve({}, {**SLURM, "SLURM_NNODES": "1", "SLURM_NODEID": "0"}) is None
    assert resolve({"nnodes": 1}, SLURM) is None  # the flag keeps a Slurm job on one machine
    # a process's own RANK outside a multi-pod job is no node rank
    assert resolve({}, {"RANK": "3", "MASTER_ADDR": "h"}) is None


def test_slurm_alone():
    assert resolve({}, SLURM) == MultiNodeArgs(
        nnodes=4,
        spare_nodes=0,
        node_rank=2,
        coordinator_host="gpu-07",
        coordinator_port=coordinator_port(4242),
        job_id="slurm-4242",
        source="slurm",
        node_name="gpu-09",
        rdzv_backend="c10d",
    )
    # the node rank from SLURM_PROCID where SLURM_NODEID is missing, the node
    # count and list from the job's variables where the step's are
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_NODEID", "SLURM_NNODES")}
    del env["SLURM_STEP_NODELIST"]
    args = resolve({}, {**env, "SLURM_JOB_NODELIST": "a[3-6]"})
    assert (args.node_rank, args.nnodes, args.coordinator_host) == (2, 4, "a3")


def test_flags_win_over_the_environment():
    flags = {
        "nnodes": "3:4",
        "node_rank": 0,
        "rdzv_endpoint": "head:1234",
        "rdzv_id": "run7",
        "rdzv_backend": "static",
        "nproc_per_node": 8,  # no say in where the machines are
    }
    args = resolve(flags, {**SLURM, **POD})
    assert args == MultiNodeArgs(3, 1, 0, "head", 1234, "run7", "flags", "gpu-09", "static")
    # one flag given: the rest from below, each from the first source naming it
    args = resolve({"nnodes": "4:5"}, SLURM)
    assert (args.nnodes, args.spare_nodes, args.node_rank, args.coordinator_host) == (
        4,
        1,
        2,
        "gpu-07",
    )
    assert args.source == "flags"
    # --master-addr/--master-port name the coordinator as well
    args = resolve({"master_addr": "10.0.0.1", "master_port": "29500"}, SLURM)
    assert (args.coordinator_host, args.coordinator_port) == ("10.0.0.1", 29500)
    # MASTER_ADDR/MASTER_PORT (an sbatch script's, for torchrun) before Slurm's
    args = resolve({}, {**SLURM, "MASTER_ADDR": "gpu-08", "MASTER_PORT": "29500"})
    assert (args.coordinator_host, args.coordinator_port) == ("gpu-08", 29500)
    assert args.source == "torchrun-env"


def test_kubernetes_pods():
    assert torchrun_env(POD) == {
        "nnodes": "2",
        "node_rank": "1",
        "nproc_per_node": "8",
        "master_addr": "train-master-0",
        "master_port": "23456",
    }
    args = resolve({}, POD)
    assert args == MultiNodeArgs(2, 0, 1, "train-master-0", 23456, None, "torchrun-env")
    # the pod's index as RANK where no node rank is given
    pod = {k: v for k, v in POD.items() if k != "PET_NODE_RANK"}
    assert resolve({}, {**pod, "RANK": "0"}).node_rank == 0
    # an elastic PyTorchJob: MIN:MAX, a c10d endpoint, a rendezvous id; IPv6 too
    elastic = {
        "PET_NNODES": "2:3",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "[fd00::1]:29400",
        "PET_RDZV_ID": "train",
        "PET_MAX_RESTARTS": "3",
    }
    args = resolve({}, elastic)
    assert args == MultiNodeArgs(2, 1, None, "fd00::1", 29400, "train", "torchrun-env")
    # an endpoint without a port: torchrun's default port
    args = resolve({}, {**elastic, "PET_RDZV_ENDPOINT": "head"})
    assert (args.coordinator_host, args.coordinator_port) == ("head", DEFAULT_PORT)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"node_rank": 4}, SLURM, r"--node-rank='4': want a whole number in 0\.\.3$"),
        ({"nnodes": "2:3", "node_rank": 3}, SLURM, r"in 0\.\.2 \(2 training \+ 1 spare"),
        ({"node_rank": -1}, SLURM, r"--node-rank='-1': want a whole number in 0\.\.3"),
        ({"node_rank": 1}, {}, r"--node-rank='1': .* 0\.\.0 \(a job of one machine\)"),
        ({}, {**SLURM, "SLURM_NODEID": "x"}, r"SLURM_NODEID='x': want a whole number"),
        ({}, {**POD, "PET_NODE_RANK": "2"}, r"PET_NODE_RANK='2': want .* 0\.\.1"),
        ({"nnodes": "2:1"}, {}, r"--nnodes='2:1': want N or MIN:MAX"),
        ({}, {"PET_NNODES": "0"}, r"PET_NNODES='0': want N or MIN:MAX"),
        ({"master_port": 70000}, SLURM, r"--master-port='70000': want .* 1\.\.65535"),
        ({}, {**SLURM, "MASTER_PORT": "0"}, r"MASTER_PORT='0': want .* 1\.\.65535"),
        ({"rdzv_endpoint": "h:99999"}, SLURM, r"the port of --rdzv-endpoint='99999'"),
        ({"rdzv_endpoint": "[::1"}, SLURM, r"--rdzv-endpoint='\[::1': want HOST"),
        ({"rdzv_endpoint": "a:1", "master_addr": "b"}, SLURM, r"name different coordinators"),
        ({"rdzv_endpoint": "a:1", "master_port": 2}, SLURM, r"--master-port='2' name diff"),
        ({"master_addr": " "}, SLURM, r"--master-addr=' ': want a host name"),
        ({"rdzv_backend": "zk"}, SLURM, r"--rdzv-backend='zk': want one of \['c10d', 'st"),
        ({"rdzv_backend": "etcd"}, SLURM, r"--rdzv-backend=etcd needs the etcd cluster's client"),
        (
            {"rdzv_backend": "etcd", "rdzv_endpoint": "e1:2379,e2:0"},
            SLURM,
            r"--rdzv-endpoint: bad etcd endpoint 'e2:0'",
        ),
        ({"nnodes": 2, "rdzv_backend": "static", "master_addr": "h"}, {}, r"static needs"),
        ({"nnodes": 2}, {}, r"a job of 2 machines needs its coordinator's host"),
        ({"rdzv_id": "a/b"}, SLURM, r"--rdzv-id='a/b': want letters, digits"),
        ({}, {**SLURM, "SLURM_JOB_ID": "x"}, r"SLURM_JOB_ID='x' is not a Slurm job id"),
        ({}, {**SLURM, "SLURM_JOB_NODELIST": "n[", "SLURM_STEP_NODELIST": ""}, r"'\[' not"),
    ],
)
def test_bad_or_conflicting_values_name_the_flag_or_variable(flags, env, message):
    with pytest.raises(ValueError, match=message):
        resolve(flags, env)


def test_slurm_outside_one_task_per_machine_is_refused():
    """The batch script (or an salloc shell) has SLURM_NODEID=0 but is no task of a
    step: a launcher there would wait forever for machines nobody started. Several
    tasks per node would be several launchers with one node rank."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(
        ValueError, match=r"SLURM_NNODES=4 but .* `srun --ntasks-per-node=1 inprocess-run"
    ):
        resolve({}, batch)
    assert resolve({"nnodes": 1}, batch) is None  # what the message offers
    # given the size and the coordinator, no node rank from the batch script's variables
    args = resolve({"nnodes": 4, "master_addr": "gpu-07"}, batch)
    assert args.node_rank is None
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x4\)': .* once per"):
        resolve({}, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x4)"})


# --- a Wrapper script started by srun directly --------------------------------------

#: the second task on the second node of `srun -N2 -n3 python train.py`
TASK = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_TASKS_PER_NODE": "2,1",
    "SLURM_NTASKS_PER_NODE": "2",  # inherited from the batch script: not this step's
    "SLURM_STEP_NODELIST": "n[3-4]",
    "SLURM_JOB_NODELIST": "n[1-4]",
}


def test_slurm_task_env():
    assert slurm_task_env(TASK) == {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "n3",  # the step's first node: task 0 runs there
        "MASTER_PORT": str(master_port(77)),
    }
    # the job's variables where the step's are missing
    job_only = {
        k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"
    }
    found = slurm_task_env(job_only)
    assert (found["LOCAL_WORLD_SIZE"], found["MASTER_ADDR"]) == ("1", "n1")
    found = slurm_task_env({**job_only, "SLURM_TASKS_PER_NODE": ""})
    assert found["LOCAL_WORLD_SIZE"] == "2"  # SLURM_NTASKS_PER_NODE, the last resort
    # nothing set is overridden
    assert "MASTER_PORT" not in slurm_task_env({**TASK, "MASTER_PORT": "1234"})
    # a launcher's workers (RANK or WORLD_SIZE set), the batch script, no Slurm: nothing
    assert slurm_task_env({**TASK, "RANK": "0"}) == {}
    assert slurm_task_env({**TASK, "WORLD_SIZE": "3"}) == {}
    assert slurm_task_env({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}) == {}
    assert slurm_task_env({}) == {}
    with pytest.raises(ValueError, match=r"SLURM_PROCID=3 must be below SLURM_STEP_NUM_TASKS=3"):
        slurm_task_env({**TASK, "SLURM_PROCID": "3"})
    with pytest.raises(ValueError, match=r"SLURM_LOCALID='-1' must be an integer >= 0"):
        slurm_task_env({**TASK, "SLURM_LOCALID": "-1"})


def test_apply_slurm_task_env_fills_a_mapping():
    env = dict(TASK, MASTER_ADDR="head")
    found = apply_slurm_task_env(env)
    assert "MASTER_ADDR" not in found and env["MASTER_ADDR"] == "head"
    assert env["RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "1"
    assert apply_slurm_task_env(env) == {}  # RANK is set now


def test_wrapper_reads_the_slurm_task_env(monkeypatch):
    """A Wrapper built in a task of srun fills the variables before anything reads
    them: its device checks already see LOCAL_RANK, its call RANK and WORLD_SIZE."""
    # (set, then deleted: so that what the Wrapper sets is removed again at the end;
    # a delenv of an absent variable alone records nothing to undo)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", "29999")
    for name, value in {**TASK, "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)

    inprocess.Wrapper(enabled=False)
    assert "RANK" not in os.environ  # a disabled Wrapper changes nothing

    wrapper = inprocess.Wrapper()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "3")
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "2")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("n3", "29999")
    devices = {check.device_index for check in wrapper.restart_health_check.instances}
    assert devices == {1}
    state = inprocess.state.State()
    assert (state.rank, state.world_size) == (2, 3)


def test_etcd_rendezvous_names_etcd_and_this_machine():
    """With ``--rdzv-backend etcd`` the endpoint names etcd's members; the coordinator
    is elected, so this machine's own address is where it listens should it lead."""
    args = resolve(
        {"rdzv_backend": "etcd", "rdzv_endpoint": "e1:2379,https://e2", "master_addr": "10.0.0.7"},
        SLURM,
    )
    assert args.rdzv_backend == "etcd"
    assert args.etcd_endpoints == ("http://e1:2379", "https://e2:2379")
    assert (args.coordinator_host, args.coordinator_port) == ("10.0.0.7", 0)  # a free port
    assert args.job_id == "slurm-4242" and args.node_rank == 2
    # a pod's MASTER_ADDR/PET_MASTER_* name another machine: this one's name is used
    pod = {**POD, "PET_RDZV_BACKEND": "etcd", "PET_RDZV_ENDPOINT": "etcd:2379", "PET_RDZV_ID": "j"}
    args = resolve({}, pod)
    assert (args.coordinator_host, args.coordinator_port) == (socket.gethostname(), 0)
