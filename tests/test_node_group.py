"""The node group (inprocess.node): leadership, local deaths, node heartbeats, fault news."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from inprocess import node
from inprocess import protocol as P
from inprocess._net import free_port
from inprocess.store import PrefixStore, TCPStore

pytestmark = pytest.mark.timeout(60)

NS = "inprocess/job/g0/call0"
A, B, C, D = "0/0.aaaaaaaaaa", "1/0.bbbbbbbbbb", "2/0.cccccccccc", "3/0.dddddddddd"


@pytest.fixture
def tcp():
    server = TCPStore(
        host_name="127.0.0.1", port=free_port(), is_master=True,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    stranger = TCPStore(host_name="127.0.0.1", port=server.port, is_master=False)
    pair = [PrefixStore(NS, server), stranger]
    del server, stranger
    yield pair
    pair.clear()  # the fixture's value outlives this teardown: it must hold no store


@pytest.fixture
def group(tmp_path):
    path = node.group_dir(NS, "n0", f"file://{tmp_path}")  # a test's own
    yield path
    shutil.rmtree(path, ignore_errors=True)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def leader(group: str, store=None, timeout: float = 2.0) -> node.NodeLeader:
    return node.NodeLeader(
        group, "n0", lambda: store, heartbeat_interval=0.5, heartbeat_timeout=timeout,
        interval=0.05, fault_chunk=1.0,
    )  # fmt: skip


def test_node_names_come_from_the_environment_and_are_checked(monkeypatch):
    monkeypatch.setenv(node.NODE_ENV, "node-7.rack_2")
    assert node.node_name() == "node-7.rack_2"
    for bad in ("", "a/b", "-x", "x" * 65, "a b"):
        monkeypatch.setenv(node.NODE_ENV, bad)
        with pytest.raises(ValueError, match="INPROCESS_NODE must be"):
            node.node_name()
    monkeypatch.delenv(node.NODE_ENV)
    assert P.valid_name(node.node_name())


def test_a_group_beats_under_a_name_of_its_own(tcp, tmp_path, monkeypatch):
    """Ranks of one node with different private directories form two groups: each
    beats apart (one group's beats never hide the other's silence)."""
    store, _ = tcp
    first, name = node.group_of(NS, "n0", store)
    assert name.startswith("n0.") and P.valid_name(name)
    assert name == node.group_of(NS, "n0", store)[1]
    monkeypatch.setattr(node, "user_dir", lambda base=None: "/var/tmp/inprocess-x")
    second, other = node.group_of(NS, "n0", store)
    assert second != first and other != name


def test_groups_differ_by_store_call_and_node():
    base = node.group_dir(NS, "n0", "tcp://h:1")
    assert base == node.group_dir(NS, "n0", "tcp://h:1")
    assert len({base, node.group_dir(NS, "n1", "tcp://h:1"), node.group_dir(NS, "n0", "tcp://h:2"),
                node.group_dir(NS + "x", "n0", "tcp://h:1")}) == 4  # fmt: skip
    assert len(os.path.join(base, "1048575_1048575.aaaaaaaaaa.s")) < 108  # fits sockaddr_un


def test_leadership_passes_on_when_its_holder_dies_and_the_last_to_leave_cleans_up(group):
    member = node.NodeMember(group, A, os.getpid())
    member.join()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from inprocess import node; fd = node._try_leadership(sys.argv[1]);"
         "print(fd is not None, flush=True); time.sleep(60)", group],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "True"
        assert node._try_leadership(group) is None  # held by the other process
        # leaving while another leads: the directory stays, for the leader to remove
        member.leave(finished=True)
        assert os.path.isdir(group)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    fd = node._try_leadership(group)
    assert fd is not None  # the kernel released the dead holder's lock
    node.remove_if_empty(group, fd)
    assert not os.path.exists(group)


def test_fault_counts_reach_every_member_over_its_socket(group):
    members = [node.NodeMember(group, identity, os.getpid()) for identity in (A, B)]
    for member in members:
        member.join()
    lead = leader(group)
    lead.send(3)
    lead.send(None)
    assert [m.receive(5) for m in members] == [3, 3]
    assert [m.receive(5) for m in members] == [None, None]
    assert members[0].receive(0.05) is False  # nothing more
    # a thread blocked in receive() is woken when its member leaves, and ends
    import threading

    ended = []

    def hear() -> None:
        try:
            members[1].receive()
        except OSError:
            ended.append(True)

    listener = threading.Thread(target=hear)
    listener.start()
    time.sleep(0.1)
    members[1].leave(finished=False)
    listener.join(5)
    assert ended == [True] and not listener.is_alive()
    members[1] = node.NodeMember(group, B, os.getpid())
    members[1].join()
    # a member's registration lists what the leader needs, and nothing malformed counts
    members[0].set_peers([B, C])
    with open(os.path.join(group, "r.junk"), "w") as f:
        f.write('{"identity": "not an identity"}')
    found = {r.identity: r for r in node.registrations(group)}
    assert set(found) == {A, B} and found[A].peers == [B, C]
    for member in members:
        member.leave(finished=True)
    os.unlink(os.path.join(group, "r.junk"))
    node.remove_if_empty(group)
    assert not os.path.exists(group)


def test_a_rank_dead_with_its_monitor_is_declared_at_once_a_stale_registration_never(tcp, group):
    store, _ = tcp
    rank, monitor = sleeper(), sleeper()
    os.makedirs(group, mode=0o700)
    live = node.Registration(A, rank.pid, node.process_start_time(rank.pid), monitor.pid, [B])
    # registrations whose processes were gone before this leader saw them: another
    # job's left behind (B: never placed in this store) is removed, never reported;
    # a rank of this job that died at once (C: placed on this node) is reported
    stale = node.Registration(B, 2**22 - 1, 1, 2**22 - 2, [])
    quick = node.Registration(C, 2**22 - 3, 1, 2**22 - 4, [])
    store.place(C, "n0")
    for registration in (live, stale, quick):
        with open(os.path.join(group, node._member_file(registration.identity)), "w") as f:
            f.write(registration.encode())
    lead = leader(group, store)
    lead.refresh()
    assert set(lead.watched) == {A}
    lead.reap(store)
    assert not os.path.exists(os.path.join(group, node._member_file(B)))
    assert not os.path.exists(os.path.join(group, node._member_file(C)))
    assert store.terminated() == {C}
    rank.kill()
    rank.wait()
    lead.refresh()
    lead.reap(store)  # its monitor lives: it reports, not the leader
    assert not store.is_terminated(A) and A in lead.watched
    monitor.kill()
    monitor.wait()
    lead.reap(store)
    assert store.is_terminated(A) and A not in lead.watched
    assert "died with its monitor process" in store.fault_log()[-1]["reason"]
    assert not store.is_terminated(B)
    lead.close()


def test_a_silent_node_is_declared_a_beating_or_finished_one_is_not(tcp, group):
    store, stranger = tcp
    me = sleeper()
    try:
        lead = leader(group, store, timeout=2.0)
        start = node.process_start_time(me.pid)
        registration = node.Registration(A, me.pid, start, me.pid, [B, C, D])
        os.makedirs(group, mode=0o700)
        with open(os.path.join(group, node._member_file(A)), "w") as f:
            f.write(registration.encode())
        lead.refresh()
        for identity, where in ((B, "n1"), (C, "n2"), (D, "n3")):
            store.place(identity, where)
        store.send_node_heartbeat("n1", [B])
        store.send_node_heartbeat("n2", [C, "4/0.eeeeeeeeee"])
        store.send_node_heartbeat("n3", [D])
        store.mark_completed(D, 0)  # finished: its node stops beating, it is not lost
        t = 1000.0
        lead.watch_nodes(store, t)
        # a stranger's beat for the silent node is not a beat
        stranger.set(f"{NS}/{P.node_key(P.NODE_BEAT, 'n2')}", f"{2**62} {C}")
        stranger.get(f"{NS}/{P.node_key(P.NODE_BEAT, 'n2')}")
        for step in range(1, 6):
            store.send_node_heartbeat("n1", [B])
            lead.watch_nodes(store, t + step)
        assert store.terminated() == {C, "4/0.eeeeeeeeee"}  # the silent node's ranks, all
        reasons = {e["rank"]: e["reason"] for e in store.fault_log()}
        assert reasons[C] == "terminated: no heartbeat for 3.00s (node n2)", reasons
        assert not store.is_terminated(B) and not store.is_terminated(D)
        before = len(store.fault_log())
        store.send_node_heartbeat("n1", [B])
        lead.watch_nodes(store, t + 9)
        assert len(store.fault_log()) == before  # declared once
    finally:
        lead.close()
        me.kill()
        me.wait()


def test_a_peer_whose_placement_a_stranger_destroyed_is_never_declared(tcp, group, caplog):
    """Every member is placed before it first arrives: an unreadable placement is a
    stranger's overwrite, logged once, and never an expulsion."""
    store, stranger = tcp
    lead = leader(group, store, timeout=2.0)
    me = sleeper()
    try:
        os.makedirs(group, mode=0o700)
        registration = node.Registration(A, me.pid, node.process_start_time(me.pid), me.pid, [B])
        with open(os.path.join(group, node._member_file(A)), "w") as f:
            f.write(registration.encode())
        lead.refresh()
        store.place(B, "n1")
        stranger.set(f"{NS}/{P.PLACED}/{B}", "n1")  # overwritten: no authentic placement
        stranger.get(f"{NS}/{P.PLACED}/{B}")  # (a set is not answered: this one is, after it)
        with caplog.at_level(logging.WARNING, "inprocess.node"):
            for t in (0.0, 1.0, 5.0, 50.0):
                lead.watch_nodes(store, t)
        assert not store.is_terminated(B)
        assert [r.getMessage() for r in caplog.records if r.name == "inprocess.node"] == [
            f"rank {B} has no authentic placement: its node is not watched"
        ]
        store.place(B, "n1")  # placed again: watched from then on
        lead.watch_nodes(store, 60.0)
        assert lead.node_of[B] == "n1" and "n1" in lead.nodes_seen
    finally:
        lead.close()
        me.kill()
        me.wait()


def test_the_leader_beats_for_its_node_and_hands_out_fault_counts(tcp, group):
    """A leader thread as the monitor process runs it, with a real store."""
    store, _ = tcp
    client = store.client_spec()
    members = [node.NodeMember(group, identity, os.getpid()) for identity in (A, B)]
    for member in members:
        member.join()
    lead = node.NodeLeader(
        group, "n0", client.connect, heartbeat_interval=0.2, heartbeat_timeout=1.0,
        interval=0.05, fault_chunk=1.0,
    )  # fmt: skip
    import threading

    thread = threading.Thread(target=lead.run, daemon=True)
    thread.start()
    try:
        assert lead.leading.wait(10)
        assert [m.receive(10) for m in members] == [0, 0]  # the watch's first count
        deadline = time.monotonic() + 10
        while store.node_heartbeat("n0")[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stamp, ranks = store.node_heartbeat("n0")
        assert stamp > 0 and sorted(ranks) == [A, B]
        store.record_fault(A, "RuntimeError: boom")
        assert [m.receive(10) for m in members] == [1, 1]
        deadline = time.monotonic() + 10
        while store.node_heartbeat("n0")[0] == stamp and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.node_heartbeat("n0")[0] > stamp  # beats go on
    finally:
        fd = lead.stop()
        members[0].leave(finished=True)
        members[1].leave(finished=True, lock_fd=fd)
        thread.join(10)
        lead.fault_watch.join(10)
    assert not thread.is_alive() and not lead.fault_watch.is_alive()
    assert not os.path.exists(group)


def test_stale_groups_are_swept_live_or_fresh_ones_never(tmp_path, group):
    """What a job killed whole leaves (its processes gone, its lock free) is removed by
    the next leader; a group with a live rank, a leader, or a recent change stays."""
    root = os.path.dirname(group)
    me = sleeper()
    made = []
    try:
        def make(alive: bool, age: float) -> str:
            path = node.group_dir(NS, f"swept{len(made)}", f"file://{tmp_path}")
            os.makedirs(path, mode=0o700)
            pid = me.pid if alive else 2**22 - 5
            start = node.process_start_time(me.pid) if alive else 1
            with open(os.path.join(path, node._member_file(A)), "w") as f:
                f.write(node.Registration(A, pid, start, 2**22 - 6, []).encode())
            os.utime(path, (time.time() - age, time.time() - age))
            made.append(path)
            return path

        dead, live, fresh, led = make(False, 120), make(True, 120), make(False, 1), make(False, 120)
        holder = node._try_leadership(led)
        os.utime(led, (time.time() - 120, time.time() - 120))
        try:
            assert node.sweep_stale_groups(root, group) >= 1
        finally:
            os.close(holder)
        assert not os.path.exists(dead)
        assert all(os.path.exists(p) for p in (live, fresh, led))
    finally:
        me.kill()
        me.wait()
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
