"""Coordinator election under an etcd lease, guarded writes and the controller's
state in etcd, against a real 3-member etcd cluster (tests/etcd_cluster.py).

Candidates are Elections of this process, each with its own etcd client; a
frozen machine is simulated by freezing a leader's keepalive thread (its lease
then expires in etcd while the leader still holds its term)."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from inprocess import security
from inprocess.failover import policy as P
from inprocess.failover.etcd import Etcd
from inprocess.failover.etcd_state import EtcdStateStore
from inprocess.failover.leadership import Election, Leader, NotLeader, job_prefix
from inprocess.failover.spec import JobSpec
from inprocess.failover.state import StateError, StateExistsError, StateFileError

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-of-the-job-" + "x" * 20
TTL = 3


class Candidates:
    """Elections of one job, each on its own client; closes them all."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.job = f"job-{uuid.uuid4().hex[:8]}"
        self.clients: list[Etcd] = []
        self.elections: list[Election] = []
        self.lost: dict[str, int] = {}
        self.threads: list[threading.Thread] = []

    def client(self, timeout: float = 2.0) -> Etcd:
        client = Etcd(self.endpoints, timeout=timeout)
        self.clients.append(client)
        return client

    def new(
        self, name: str, port: int, secret: str = SECRET, ttl: int = TTL, timeout: float = 2.0
    ) -> Election:
        self.lost[name] = 0

        def on_lost() -> None:
            self.lost[name] += 1

        election = Election(
            self.client(timeout),
            self.job,
            name,
            f"127.0.0.1:{port}",
            secret,
            ttl=ttl,
            on_lost=on_lost,
        )
        self.elections.append(election)
        return election

    def campaign_in_background(self, election: Election, timeout: float = 30) -> dict:
        """Runs ``election.campaign`` in a thread; the dict gets "leader" or "error"."""
        out: dict = {}

        def run() -> None:
            try:
                out["leader"] = election.campaign(timeout=timeout)
            except NotLeader as ex:
                out["error"] = ex

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        out["thread"] = thread
        self.threads.append(thread)
        return out

    def close(self) -> None:
        for election in self.elections:
            election.close()
        for thread in self.threads:
            thread.join(60)
        for client in self.clients:
            client.close()


@pytest.fixture
def candidates(shared_etcd_cluster):
    group = Candidates(shared_etcd_cluster.endpoints)
    try:
        yield group
    finally:
        group.close()


def wait_for(predicate, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def make_state(job_id: str, state_dir):
    spec = JobSpec(
        job_id=job_id,
        entrypoint=["train.py"],
        nnodes=2,
        nproc_per_node=2,
        state_dir=str(state_dir),
    )
    state = P.new_job_state(spec, now=1.0)
    state, _ = P.start_job(state, now=2.0)
    for w in range(4):
        state = P.worker_started(state, w, pid=100 + w, start_time=1000.0 + w, now=3.0)
    return state


def with_event(state, message: str):
    state = state.copy()
    state.log_event("test", message, now=4.0)
    return state


def test_one_leads_successors_take_over_and_stale_writes_fail(candidates):
    a, b = candidates.new("a", 1001), candidates.new("b", 1002)
    first = a.campaign(timeout=30)
    assert a.is_leader() and a.term == first.term
    assert first == Leader("a", "127.0.0.1:1001", first.term, first.lease)
    assert b.leader() == first and a.leader() == first
    with pytest.raises(TimeoutError):
        b.campaign(timeout=TTL)  # a leads: b waits, then gives up
    assert not b.is_leader() and b.term is None
    with pytest.raises(NotLeader):
        b.guarded_put(b.prefix + "decision", "from b")
    a.guarded_put(a.prefix + "decision", "a, term 1")

    # a resigns: b's campaign returns, with a larger term
    waiting = candidates.campaign_in_background(b)
    time.sleep(0.3)
    assert "leader" not in waiting
    a.resign()
    waiting["thread"].join(30)
    second = waiting["leader"]
    assert b.is_leader() and not a.is_leader()
    assert second.term > first.term and a.leader() == second

    # b's machine freezes: its lease expires in etcd and a takes over, with a larger term
    b.guarded_put(b.prefix + "decision", "b, term 2")
    waiting = candidates.campaign_in_background(a)
    b._frozen.set()
    waiting["thread"].join(30)
    third = waiting["leader"]
    assert third.term > second.term and a.is_leader() and b.leader() == third
    # b, resumed, still holds its term; its write fails in etcd and changes nothing
    assert b._term == second.term
    with pytest.raises(NotLeader):
        b.guarded_put(b.prefix + "decision", "b, stale")
    kv = candidates.clients[0].get(a.prefix + "decision")
    assert kv.value == b"b, term 2"
    b._frozen.clear()
    wait_for(lambda: candidates.lost["b"] == 1, what="b's on_lost")
    assert not b.is_leader() and b.term is None
    a.guarded_put(a.prefix + "decision", "a, term 3")
    time.sleep(TTL)  # a keeps leading: its lease is renewed
    assert a.is_leader() and a.leader() == third
    assert candidates.lost == {"a": 0, "b": 1}  # once per loss, never on resign


def test_records_without_the_secret_lead_nobody(candidates):
    etcd = candidates.client()
    a = candidates.new("a", 1001)
    key = a.leader_key

    # garbage, and a record sealed with another secret: no leader; a takes over
    etcd.put(key, "i am the leader now")
    assert a.leader() is None
    stranger = candidates.new("stranger", 6666, secret="another-secret-of-20-chars")
    assert stranger.campaign(timeout=30).identity == "stranger"
    assert a.leader() is None
    won = a.campaign(timeout=30)
    assert a.leader() == won and won.endpoint == "127.0.0.1:1001"
    stranger.close()

    # a genuine record copied without its lease (plain put, or under a lease of
    # the copier's own) is not a leader
    record = etcd.get(key).value
    assert security.open_first(key, record, SECRET) is not None
    a.resign()
    assert a.leader() is None
    etcd.put(key, record)
    assert a.leader() is None
    other_lease = etcd.lease_grant(30)
    etcd.put(key, record, lease=other_lease)
    assert a.leader() is None
    b = candidates.new("b", 1002)
    assert b.campaign(timeout=30).identity == "b"
    assert a.leader().identity == "b"
    etcd.lease_revoke(other_lease)


def test_bad_arguments_name_them(shared_etcd_cluster):
    etcd = Etcd(shared_etcd_cluster.endpoints)
    try:
        good = dict(job="job", identity="me", endpoint="h:1", secret=SECRET)
        for name, bad in [
            ("job", "a/b"),
            ("identity", ""),
            ("endpoint", "nohost"),
            ("secret", "short"),
            ("ttl", 1),
        ]:
            with pytest.raises(ValueError, match=name):
                Election(etcd, **{**good, name: bad})
        with pytest.raises(ValueError, match="guarded_put key"):
            Election(etcd, **good).guarded_put("/elsewhere", "x")
    finally:
        etcd.close()


def test_state_store_in_etcd(candidates, tmp_path):
    etcd = candidates.client()
    a, b = candidates.new("a", 1001), candidates.new("b", 1002)
    a.campaign(timeout=30)
    store = EtcdStateStore(a)
    assert store.path == f"etcd:{job_prefix(candidates.job)}state"
    assert not store.exists()
    with pytest.raises(FileNotFoundError):
        store.load()
    state = make_state("train", tmp_path)
    with pytest.raises(StateError, match="neither created nor loaded"):
        store.save(state)
    store.create(state)
    assert store.exists() and store.owner == "train"
    assert EtcdStateStore(a).load() == state
    with pytest.raises(StateExistsError, match="'train' in stage RUNNING"):
        EtcdStateStore(a).create(make_state("other", tmp_path))
    with pytest.raises(StateError, match="belongs to job 'train'"):
        store.save(make_state("other", tmp_path))

    state = with_event(state, "saved 1")
    store.save(state)
    assert EtcdStateStore(b).load() == state

    # a's machine freezes; b takes over and loads what a saved last
    waiting = candidates.campaign_in_background(b)
    a._frozen.set()
    waiting["thread"].join(30)
    assert b.is_leader()
    stale = with_event(state, "stale")
    with pytest.raises(NotLeader):
        store.save(stale)
    new_store = EtcdStateStore(b)
    assert new_store.load() == state
    a._frozen.clear()
    newer = with_event(state, "saved 2")
    new_store.save(newer)
    assert EtcdStateStore(a).load() == newer

    # a value without the job's seal fails to load, and is never overwritten
    sealed = etcd.get(new_store.key).value
    tampered = sealed.replace(b"saved 2", b"saved 3")
    assert tampered != sealed
    for value in (tampered, b"{}", security.seal(new_store.key, "{}", "other-secret-0123456")):
        etcd.put(new_store.key, value)
        with pytest.raises(StateFileError, match=f"etcd:{new_store.key}"):
            EtcdStateStore(b).load()
        with pytest.raises(StateFileError, match="cannot be loaded"):
            EtcdStateStore(b).create(newer)
    etcd.put(new_store.key, security.seal(new_store.key, "{}", SECRET))
    with pytest.raises(StateFileError, match="not a state file"):
        EtcdStateStore(b).load()


def test_leader_rides_out_etcd_member_losses(etcd_cluster, caplog):
    group = Candidates(etcd_cluster.endpoints)
    try:
        # each etcd call gives up after 1 s; the lease lives 5 s without renewal
        leader = group.new("a", 1001, ttl=5, timeout=1.0)
        leader.campaign(timeout=30)
        key = leader.prefix + "decision"
        leader.guarded_put(key, "before")

        # one member of three lost: quorum holds, nothing is lost
        etcd_cluster.kill(0)
        deadline = time.monotonic() + 4  # two renewals at least
        n = 0
        while time.monotonic() < deadline:
            n += 1
            leader.guarded_put(key, f"write {n}")
            time.sleep(0.2)
        assert leader.is_leader() and group.lost["a"] == 0
        before = group.clients[0].get(key)
        assert before.value == f"write {n}".encode()

        # two lost: the write waits (one warning), and ends once a member is back
        caplog.set_level(logging.INFO, logger="inprocess.failover.leadership")
        caplog.clear()
        etcd_cluster.kill(1)
        out: dict = {}

        def write() -> None:
            try:
                out["revision"] = leader.guarded_put(key, "during the outage")
            except NotLeader as ex:
                out["error"] = ex

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        time.sleep(2.5)
        assert thread.is_alive()  # waits for etcd
        etcd_cluster.restart(1)
        thread.join(60)
        assert not thread.is_alive()
        after = group.clients[0].get(key)
        waits = [r for r in caplog.records if "waits for it" in r.getMessage()]
        assert len(waits) == 1 and waits[0].levelno == logging.WARNING
        assert any("waited" in r.getMessage() for r in caplog.records)
        if "revision" in out:  # written once
            assert after.value == b"during the outage"
            assert after.version == before.version + 1 and after.mod_revision == out["revision"]
        else:  # the lease could not be renewed in time: not written, or written once
            assert isinstance(out["error"], NotLeader)
            assert after.version in (before.version, before.version + 1)
            wait_for(lambda: group.lost["a"] == 1, what="on_lost")
        assert group.lost["a"] == (0 if "revision" in out else 1)
    finally:
        group.close()


def test_a_coordinator_writes_under_its_launcher_s_leadership(candidates, tmp_path, monkeypatch):
    """The elected launcher holds the lease; its coordinator process follows it
    (``Election.follow``): its saves are guarded by the launcher's term, wait for
    the launcher to lead again, and stop where another launcher leads. The job's
    machines are kept sealed beside the state; ``job_ended`` reads the stage."""
    from inprocess.failover import etcd_member
    from inprocess.failover.backends.nodes import NodesConfig

    monkeypatch.setattr(etcd_member, "FOLLOW_WAIT", 10)
    launcher, other = candidates.new("launcher", 1001), candidates.new("other", 1002)
    launcher.campaign(timeout=30)
    follower = Election(candidates.client(), candidates.job, "launcher", "127.0.0.1:1001", SECRET)
    follower.follow()
    store = etcd_member.CoordinatorStateStore(follower, tmp_path)
    state = make_state("train", tmp_path)
    store.create(state)
    assert (tmp_path / "state.json").exists()  # the mirror for this machine's readers
    assert not etcd_member.job_ended(launcher)
    config = NodesConfig(own_slot=None, joined={0: "agent-a", 1: "agent-b"}, agreed={"n": 1})
    etcd_member.save_nodes(store, config)
    (tmp_path / "elsewhere").mkdir()
    assert etcd_member.load_nodes(store, tmp_path / "elsewhere") == config
    assert NodesConfig.load(tmp_path / "elsewhere") == config  # (saved there for the controller)
    # the launcher's lease ends (its machine froze) and it wins again: a new term;
    # the coordinator's next save waits for it and is made under that term
    launcher._frozen.set()
    wait_for(lambda: not launcher.is_leader() and launcher.etcd.get(launcher.leader_key) is None,
             30, "the lease to end")  # fmt: skip
    launcher._frozen.clear()
    wait_for(lambda: candidates.lost["launcher"] == 1, 30, "the loss reported")
    launcher.campaign(timeout=30)
    state = with_event(state, "after the freeze")
    store.save(state)
    assert EtcdStateStore(other).load() == state
    # another launcher leads: the coordinator's save fails, nothing is written
    launcher.resign()
    other.campaign(timeout=30)
    with pytest.raises(NotLeader):
        store.save(with_event(state, "stale"))
    assert EtcdStateStore(other).load() == state
    # a stranger's record of the machines is not taken
    other.etcd.put(other.prefix + "nodes", b"{}")
    with pytest.raises(StateFileError, match="no record of the job's machines"):
        etcd_member.load_nodes(EtcdStateStore(other), tmp_path)
    # the stage read by a launcher elected after the end
    stopped = P.stopped(P.request_stop(state, 0, "done", now=5.0).state, now=6.0)
    successor = EtcdStateStore(other)
    successor.load()
    successor.save(stopped)
    assert etcd_member.job_ended(other)
    # the launcher leads again, but another leadership wrote the state meanwhile:
    # not the coordinator's to overwrite
    other.resign()
    launcher.campaign(timeout=30)
    with pytest.raises(NotLeader, match="changed under another leadership"):
        store.save(with_event(state, "over another's decision"))
    assert etcd_member.job_ended(launcher)
    follower.close()


def test_the_hand_off_to_a_coordinator_process_is_checked():
    from inprocess.failover.etcd_member import COORDINATOR_ENV, Handoff

    handoff = Handoff(7, "m/1/ab", "127.0.0.1:9", ("http://127.0.0.1:2379",), "j")
    assert Handoff.from_env({COORDINATOR_ENV: handoff.to_env()}) == handoff
    assert Handoff.from_env({}) is None
    with pytest.raises(ValueError, match=COORDINATOR_ENV):
        Handoff.from_env({COORDINATOR_ENV: '{"listen_fd": 1}'})
