"""``inprocess-run --backend ray`` on a real Ray cluster (issue 11).

One ``ray.cluster_utils.Cluster`` for the module (starting Ray nodes is the
slow part): a head node without CPUs (driver, controller, store) and three
nodes of one CPU each (2 job nodes + 1 spare; each bundle takes one CPU).
Skipped when Ray is not installed; ``-m "not ray"`` skips these too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from inprocess.failover.supervisor import job_processes
from inprocess.tools.ray_cluster import cluster_node

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

from test_failover_e2e import (  # noqa: E402
    ENV,
    RUN,
    TRAIN,
    Launch,
    always_crashing,
    check_after_run,
    check_clean_success,
)

from inprocess.failover.backends.ray import (  # noqa: E402
    AGENT_DIR_PREFIX,
    remove_ended_agents_dirs,
    split_worker_pid,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _is_ray_process(proc: psutil.Process) -> bool:
    """A process of Ray itself (raylet, GCS, its worker pool, agents), not of a job."""
    with contextlib.suppress(psutil.Error):
        cmd = " ".join(proc.cmdline())
        return "/ray/" in cmd or cmd.startswith(("ray::", "ray_")) or "raylet" in cmd
    return True  # gone meanwhile


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of 4 nodes on this machine at Ray's default health-check settings
    (node loss must be seen by the job itself), shut down (and checked) after the module."""
    c = ray_cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
        },
    )
    try:
        for _ in range(3):
            c.add_node(num_cpus=1)
        yield c
        # Nothing of the jobs is left on the cluster: no named actor, no placement group.
        check = (
            f"import ray; ray.init(address={c.address!r}, logging_level='ERROR');"
            "print(len(ray.util.list_named_actors(all_namespaces=True)),"
            " sorted({p['state'] for p in ray.util.placement_group_table().values()}))"
        )
        out = subprocess.run(
            [sys.executable, "-c", check], env=ENV, capture_output=True, text=True, timeout=120
        )
        assert out.stdout.split("\n")[-2] in ("0 []", "0 ['REMOVED']"), out.stdout + out.stderr
    finally:
        c.shutdown()
    # Ray itself is gone too: no process of it outlives the fixture.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if _is_ray_process(p)]
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"Ray processes left: {left}"


@pytest.fixture(autouse=True)
def no_leaks():
    """conftest's check, but Ray's own processes (the shared cluster's raylets, worker
    pool, agents) may come and go while the module's cluster lives; the cluster
    fixture checks them when it shuts down. The jobs' processes may not stay."""
    threads = set(__import__("threading").enumerate())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    fds = {int(fd) for fd in os.listdir("/proc/self/fd")}
    yield
    deadline = time.monotonic() + 10
    while True:
        new_children = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in children and not _is_ray_process(p)
        ]
        new_threads = [
            t for t in __import__("threading").enumerate() if t not in threads and t.is_alive()
        ]
        if not (new_children or new_threads) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not new_threads, f"leaked threads: {new_threads}"
    assert not new_children, f"leaked processes: {new_children}"
    leaked = set()
    for fd in {int(fd) for fd in os.listdir("/proc/self/fd")} - fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "/ray/" not in target and "session_" not in target:
                leaked.add((fd, target))
    assert not leaked, f"leaked file descriptors: {leaked}"


def _joined_after(launch: Launch) -> dict[str, float]:
    """Seconds from start to join of workers 2 and 3's first relaunch, by the job's events."""
    joined = {}
    pattern = re.compile(r"worker ([23]) incarnation 1 joined ([\d.]+)s after its start")
    for e in launch.state()["events"]:
        m = pattern.fullmatch(e["message"])
        if e["kind"] == "worker_joined" and m:
            joined[m.group(1)] = float(m.group(2))
    return joined


def _standby_pids(job_id: str) -> set[int]:
    """Pids of the job's warm standbys (every Ray node of the cluster is this machine)."""
    found = set()
    for p in job_processes(job_id):
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if (
                "inprocess.failover.standby" in cmdline
                and "--zygote" not in cmdline
                and "RANK" not in p.environ()
            ):
                found.add(p.pid)
    return found


class RayLaunch(Launch):
    """A job of 2 nodes x 2 workers on the module's Ray cluster."""

    def __init__(self, tmp, cluster, *flags, script_args=()):
        super().__init__(
            tmp,
            "--backend",
            "ray",
            "--ray-address",
            cluster.address,
            *flags,
            script=TRAIN,
            script_args=script_args,
        )

    def nodes(self) -> dict:
        return json.loads((self.state_dir / "ray_nodes.json").read_text())


def wait_for(predicate, launch, timeout, what):
    launch.wait_until(predicate, timeout=timeout, what=what)


@pytest.mark.timeout(300)
def test_worker_kill_controller_kill_and_node_loss(tmp_path, cluster):
    """One job through three faults: a worker SIGKILLed (relaunched in place, rejoins),
    the controller actor killed (restarted by Ray, recovers), and a job node removed
    from the cluster (its workers relaunched on the spare node, not counted as failures).
    Ends 0 at full world size with the exact step count."""
    with RayLaunch(
        tmp_path,
        cluster,
        "--spare-nodes",
        "1",
        "--standby",
        "1",
        script_args=["--steps", "100000", "--step-time", "0.02"],
    ) as launch:
        # the controller must know the job runs under the Wrapper before the kill:
        # a worker lost before that is a cold restart of the job, not a rejoin
        wait_for(lambda: launch.training_under_the_wrapper(10), launch, 150, "training")
        # 1. a worker dies: the survivors go on in-process, its replacement rejoins
        # (made from a warm standby of its node's agent)
        standbys = _standby_pids(launch.job_id)
        killed_at = time.time()
        # state.json has slot-qualified pids (one machine's pids may equal another's)
        slot, pid = split_worker_pid(launch.state()["workers"]["1"]["pid"])
        assert slot == launch.state()["node_slots"]["0"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: launch.full_size_since(killed_at), launch, 90, "full size again")
        assert split_worker_pid(launch.state()["workers"]["1"]["pid"])[1] in standbys
        # 2. the controller actor's process dies: Ray restarts it, it recovers
        first = int((launch.state_dir / "controller.pid").read_text())
        os.kill(first, signal.SIGKILL)
        wait_for(
            lambda: int((launch.state_dir / "controller.pid").read_text()) != first,
            launch,
            90,
            "a restarted controller",
        )
        wait_for(
            lambda: any(e["kind"] == "recover" for e in launch.state()["events"]),
            launch,
            60,
            "recovery",
        )
        step = json.loads((launch.out / "checkpoint.json").read_text())["step"]
        wait_for(lambda: launch.running_at_step(step + 20), launch, 60, "progress")
        # 3. the Ray node of job node 1 (workers 2, 3) goes away
        victim = cluster_node(cluster, launch.nodes()[str(launch.state()["node_slots"]["1"])])
        standbys = _standby_pids(launch.job_id)  # the spare slot's among them
        lost_at = time.time()
        cluster.remove_node(victim)
        wait_for(lambda: launch.full_size_since(lost_at), launch, 120, "full size after loss")
        # the relaunched node's workers start warm: the spare slot's standby (one per
        # node) or a fork of its zygote, joining within seconds (a fresh interpreter
        # spends 15-30 s importing torch here)
        wait_for(lambda: set(_joined_after(launch)) == {"2", "3"}, launch, 60, "joins seen")
        joined = _joined_after(launch)
        moved = {split_worker_pid(launch.state()["workers"][w]["pid"])[1] for w in ("2", "3")}
        detail = json.dumps(
            {"standbys": sorted(standbys), "moved": sorted(moved), "joined_s": joined}, indent=0
        )
        assert max(joined.values()) < 10, detail
        launch.stop()
        check_clean_success(launch, None, timeout=240)
        state = launch.state()
        # the kill above; under load, one more where a rank's unwind after a restart
        # outlasts unwind_timeout and its monitor process ends it (a failure of its own)
        assert 1 <= state["worker_restarts"]["1"] <= 2, json.dumps(state["events"], indent=1)
        assert state["node_relaunches"] == 1
        assert state["node_slots"]["1"] == 2  # moved to the spare slot
        # the node's loss was not counted as failures of its workers
        assert state["worker_restarts"]["2"] == 0 and state["worker_restarts"]["3"] == 0
        lost = [e for e in state["events"] if e["kind"] == "node_lost"]
        assert len(lost) == 1
        # seen long before Ray's health check (~15 s at its defaults, which this
        # cluster keeps): by the job's own heartbeat link, or, where that races
        # with it on a busy machine, by Ray's notice that the node's agent actor
        # died (a removed node's actors die at once) or that the node itself is
        # dead (a removed node deregisters at once); whichever comes first, the
        # time bound below is what says it was not Ray's health check
        message = lost[0]["message"]
        assert any(
            seen in message
            for seen in ("heartbeat connection was closed", "the agent of node slot", "is dead")
        ), lost[0]
        assert lost[0]["time"] - lost_at < 5.0, lost[0]


@pytest.mark.timeout(240)
def test_worker_that_always_crashes_stops_the_job(tmp_path, cluster):
    with RayLaunch(
        tmp_path,
        cluster,
        "--max-restarts",  # one relaunch, then over the limit (each costs a worker start)
        "1",
        "--nnodes",  # one node is enough here
        "1",
        script_args=always_crashing(crash_step=1),
    ) as launch:
        code = launch.finish(timeout=200)
        assert code != 0, launch.output()
        state = launch.state()
        assert state["stage"] == "STOPPED" and state["exit_code"] == code
        assert "max_restarts" in state["reason"], state["reason"]
        assert state["worker_restarts"]["1"] == 2
        check_after_run(launch)
        assert not job_processes(launch.job_id)


@pytest.mark.timeout(360)
def test_ctrl_c_stops_the_job_and_leaves_nothing(tmp_path, cluster):
    with RayLaunch(
        tmp_path, cluster, script_args=["--steps", "100000", "--step-time", "0.02"]
    ) as launch:
        # a job's start under Ray on a loaded 2-core machine: every worker,
        # standby and node agent imports torch at once
        wait_for(lambda: launch.running_at_step(1), launch, 200, "training")
        launch.proc.send_signal(signal.SIGINT)
        assert launch.finish(timeout=120) == 130, launch.output()
        state = launch.state()
        assert state["exit_code"] == 130 and "SIGINT" in state["reason"]
        check_after_run(launch)  # STOPPED, no process of the job


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ray-address", "127.0.0.1:1"], "need --backend ray"),
        (["--backend", "ray", "--ray-bundle", "[1]"], "--ray-bundle must be a JSON object"),
        (["--backend", "ray", "--ray-bundle", '{"CPU": 0}'], "--ray-bundle must be"),
    ],
)
def test_bad_ray_flags_are_clear_errors(tmp_path, flags, message):
    out = subprocess.run(
        [*RUN, *flags, str(TRAIN)], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_pids_of_different_machines_never_collide():
    # Containers number their processes from 1: two machines' workers often share a pid.
    from inprocess.failover.backends.ray import PLACEHOLDER_PID, worker_pid

    a, b = worker_pid(0, 4242), worker_pid(1, 4242)
    assert a != b
    assert split_worker_pid(a) == (0, 4242) and split_worker_pid(b) == (1, 4242)
    assert split_worker_pid(worker_pid(7, PLACEHOLDER_PID + 5)) == (7, PLACEHOLDER_PID + 5)
    assert split_worker_pid(worker_pid(3, (1 << 22) - 1)) == (3, (1 << 22) - 1)


@pytest.mark.timeout(60)
def test_the_directories_of_ended_node_agents_are_removed_and_no_other(tmp_path):
    """A node agent killed with its actor (its node lost) never ran its shutdown:
    the next agent on the host removes its directory, and only such directories."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "kept").write_text("x")
        parent = tmp_path / "private"
        parent.mkdir()
        for name in (f"{ended.pid}-a", f"{os.getpid()}-b", f"{living.pid}-c", "x1-d"):
            (parent / f"{AGENT_DIR_PREFIX}{name}").mkdir()
            (parent / f"{AGENT_DIR_PREFIX}{name}" / "zygote.sock").write_text("")
        (parent / f"{AGENT_DIR_PREFIX}{ended.pid}-link").symlink_to(outside)
        remove_ended_agents_dirs(parent)
        assert sorted(p.name for p in parent.iterdir()) == sorted(
            f"{AGENT_DIR_PREFIX}{n}"
            for n in (f"{os.getpid()}-b", f"{living.pid}-c", "x1-d", f"{ended.pid}-link")
        )
        assert (outside / "kept").exists()
    finally:
        living.kill()
        living.wait()
