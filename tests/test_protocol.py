"""The restart protocol's pure decisions, codec and read API (issue 10): no processes."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from inprocess import protocol as P
from inprocess.progress_watchdog import ProgressBoard
from inprocess.store import PrefixStore, StoreMixin


class HashStore(dist.HashStore, StoreMixin):
    """An in-memory store with the Wrapper protocol."""


def rank(n: int) -> P.Arrival:
    return P.Arrival("rank", n)


# --------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("value", [rank(0), rank(7), P.JOIN, P.DISCARD, P.TIMEOUT])
def test_arrival_codec_round_trips(value):
    assert P.Arrival.decode(value.encode()) == value


def test_arrival_wire_format_is_unchanged():
    assert [v.encode() for v in (rank(3), P.JOIN, P.DISCARD, P.TIMEOUT)] == [
        "3",
        "join",
        "discard",
        "timeout",
    ]


@pytest.mark.parametrize("kind,n", [("spare", -1), ("rank", -1), ("join", 2)])
def test_bad_arrival_is_an_error(kind, n):
    with pytest.raises(ValueError, match="Arrival"):
        P.Arrival(kind, n)


# --------------------------------------------------------------------------- membership


def decide(arrivals, terminated=(), baseline=5, requests=(), gone=()):
    return P.decide_membership(arrivals, set(terminated), baseline, list(requests), set(gone))


def test_membership_orders_by_new_rank_then_joiners_by_initial_rank():
    d = decide({"a": rank(1), "b": rank(0), "3/1.x": P.JOIN, "1/1.y": P.JOIN, "c": P.DISCARD})
    assert d == P.Members(("b", "a", "1/1.y", "3/1.x"), 5)


def test_membership_retries_without_terminated_participants():
    assert decide({"a": rank(0)}, terminated={"b", "a"}) == P.Retry(("a", "b"))


@pytest.mark.parametrize(
    "arrivals,error",
    [
        ({"a": rank(0), "b": P.TIMEOUT}, "timed out on ['b']"),
        ({"a": rank(0), "b": rank(0)}, "rank 0 assigned to both a and b"),
        ({"a": rank(0), "b": rank(2)}, "assigned ranks [0, 2] have gaps"),
        ({"a": P.DISCARD}, "no rank is left"),
    ],
)
def test_membership_errors(arrivals, error):
    d = decide(arrivals)
    assert isinstance(d, P.Failed) and error in d.error


def test_unadmitted_join_request_lowers_the_baseline():
    # "2/1.z" asked to join but is neither a member nor gone: restart at once to admit it
    assert decide({"a": rank(0)}, requests=["2/1.z"]) == P.Members(("a",), 4)
    assert decide({"a": rank(0)}, requests=["2/1.z"], gone={"2/1.z"}).baseline == 5
    assert decide({"a": rank(0), "2/1.z": P.JOIN}, requests=["2/1.z"]).baseline == 5


@pytest.mark.parametrize(
    "decision",
    [
        P.Retry(("a", "b")),
        P.Failed("no rank is left"),
        P.Members(("a", "b"), 3),
    ],
)
def test_membership_codec_round_trips(decision):
    assert P.decode_membership(P.encode(decision)) == decision


PARTICIPANTS = [f"{r}/0.r{r}" for r in range(300)] + ["5/1.joiner"]


def test_a_membership_is_published_as_its_change_to_the_participants():
    """Issue 24: what every rank reads does not grow with N (the common case, survivors in
    order, one joiner, one rank discarded, fits in a fixed size)."""
    kept = tuple(p for p in PARTICIPANTS if p != "7/0.r7")
    text = P.encode(P.Members(kept, 4), PARTICIPANTS)
    assert len(text) < 200 and "0/0.r0" not in text
    assert P.decode_membership(text, PARTICIPANTS) == P.Members(kept, 4)
    many = [f"{r}/0.r{r}" for r in range(30000)]
    # the same size at any N: nothing removed, nothing listed
    removal = ',"removed":["7/0.r7"]'
    assert len(P.encode(P.Members(tuple(many), 0), many)) == len(text) - len(removal)


def test_a_reordered_membership_is_published_whole_and_still_checked():
    reordered = tuple(reversed(PARTICIPANTS))
    text = P.encode(P.Members(reordered, 1), PARTICIPANTS)
    assert P.decode_membership(text, PARTICIPANTS) == P.Members(reordered, 1)


def test_a_membership_digest_mismatch_is_caught():
    """A rank whose participants differ from the decider's (its view diverged) never
    trains on the membership it would derive."""
    text = P.encode(P.Members(tuple(PARTICIPANTS[1:]), 0), PARTICIPANTS)
    with pytest.raises(P.MembershipMismatch, match="participants differ"):
        P.decode_membership(text, PARTICIPANTS[:-1])
    # the same participants in another order: the base digest tells
    with pytest.raises(P.MembershipMismatch, match="participants differ"):
        P.decode_membership(text, list(reversed(PARTICIPANTS)))
    # a change that does not give the published result (a decider's bug or a torn value)
    data = __import__("json").loads(text)
    data["removed"] = []
    with pytest.raises(P.MembershipMismatch, match="not the decider's"):
        P.decode_membership(__import__("json").dumps(data), PARTICIPANTS)
    with pytest.raises(ValueError, match="needs the participants"):
        P.decode_membership(text)


def test_a_restart_that_changes_nobody_hands_a_rank_the_roster_it_holds():
    """Issue 24: no O(N) copy, search or digest per rank when the membership stands
    (the digest and positions of a roster are computed once)."""
    held = P.Roster(PARTICIPANTS)
    text = P.encode(P.Members(tuple(PARTICIPANTS), 2), held)
    decision = P.decode_membership(text, held)
    assert decision.members is held and decision.baseline == 2
    assert held.digest == P.membership_digest(list(PARTICIPANTS))
    assert "5/1.joiner" in held and "5/9.nobody" not in held
    assert held.position("7/0.r7") == 7 == held.position("7/0.r7", hint=7)
    assert held.position("7/0.r7", hint=3) == 7  # a wrong hint: looked up
    with pytest.raises(ValueError, match="not a member"):
        held.position("5/9.nobody")
    # a change gives a roster of its own, checked as before
    kept = P.decode_membership(P.encode(P.Members(tuple(PARTICIPANTS[1:]), 0), held), held)
    assert isinstance(kept.members, P.Roster) and kept.members == tuple(PARTICIPANTS[1:])


def test_the_initial_membership_is_published_in_a_size_that_does_not_grow_with_n():
    """Issue 24: ranks that started together have identities every rank derives; only
    the others (a worker relaunched before the job started) are listed."""
    token = P.launch_token("ip/abc/0")
    assert token == P.launch_token("ip/abc/0") != P.launch_token("ip/abc/1")
    members = [P.launch_identity(r, token) for r in range(20000)]
    assert all(map(P.valid_identity, members[:3]))
    text = P.encode_initial(members, token)
    assert text == "#20000,"
    derived = P.decode_initial(text, token)
    assert derived == tuple(members) and isinstance(derived, P.Roster)
    # the ranks of one process share the roster (one per process, not per rank)
    assert P.decode_initial(text, token) is derived
    members[7] = "7/1.relaunched"
    text = P.encode_initial(members, token)
    assert text == "#20000,7/1.relaunched,"
    assert P.decode_initial(text, token) == tuple(members)
    # another launch's token derives other identities: the digests then differ
    assert P.decode_initial("#3,", P.launch_token("other"))[0] != P.launch_identity(0, token)
    for bad in ("", "3,", "#x,", "#0,", "#3,9/0.beyond,", "#3,garbage,"):
        with pytest.raises(ValueError):
            P.decode_initial(bad, token)


def test_ring_successors_and_the_peers_record():
    members = ["0/0.a", "1/0.b", "2/0.c"]
    assert P.ring_successors(members, "2/0.c", 2) == ["0/0.a", "1/0.b"]
    assert P.ring_successors(members, "1/0.b", 5) == ["2/0.c", "0/0.a"]
    assert P.ring_successors(members, "9/0.z", 2) == [] == P.ring_successors(["0/0.a"], "0/0.a", 2)
    # handed from a rank to its monitor process on the board, not through the store
    board = ProgressBoard()
    try:
        assert board.read_text() is None and P.Peers.parse(board.read_text()) is None
        board.write_text(P.Peers(4, ("1/0.b",)).encode())
        assert P.Peers.parse(board.read_text()) == P.Peers(4, ("1/0.b",))
        board.write_text(P.Peers(5, ("2/0.c", "0/0.a")).encode())  # shorter or longer
        monitor_side = ProgressBoard(os.dup(board.fd))  # the other process's mapping
        assert P.Peers.parse(monitor_side.read_text()).iteration == 5
        monitor_side.close()
        board.write_text("garbage")
        assert P.Peers.parse(board.read_text()) is None
        with pytest.raises(ValueError, match="at most"):
            board.write_text("x" * (ProgressBoard.TEXT_BYTES + 1))
    finally:
        board.close()


# --------------------------------------------------------------------------- termination


def test_termination_admits_requests_of_new_processes_only():
    d = P.decide_termination(
        {"b", "a"},
        members=["a", "b", "c"],
        join_requests=["3/1.x", "c", "1/1.y", "0/1.dead"],
        gone={"0/1.dead"},
        cause=P.RootCause("a", "RuntimeError: boom"),
    )
    cause = P.RootCause("a", "RuntimeError: boom")
    assert d == P.Termination(("a", "b"), ("1/1.y", "3/1.x"), cause)
    assert P.admitted(d, "3/1.x") and not P.admitted(d, "c")
    assert P.decode_termination(P.encode(d)) == d
    plain = P.Termination((), ())
    assert P.decode_termination(P.encode(plain)) == plain


def test_termination_carries_what_a_rank_derives_the_next_membership_from():
    members = P.Roster(["a", "b", "c", "d"])
    d = P.decide_termination({"c", "x"}, members, [], set(), None, baseline=7)
    assert d.baseline == 7 and d.digest == P.membership_digest(["a", "b", "d"])
    assert P.decode_termination(P.encode(d)) == d
    # nobody out: the survivors are the roster itself (its digest computed once)
    assert P.survivors(members, ()) is members
    assert P.decide_termination(set(), members, [], set(), None, 3).digest == members.digest
    # without a baseline (not the Wrapper's decider): nothing to derive from
    assert P.decide_termination(set(), members, [], set(), None).digest is None


def test_only_order_keeping_assignments_derive_the_membership():
    from inprocess import Compose
    from inprocess.generation import derives_membership
    from inprocess.rank_assignment import (
        ActivateAllRanks,
        FillGaps,
        FilterCountGroupedByKey,
        Layer,
        ShiftRanks,
        Tree,
    )

    class MyShift(ShiftRanks):
        pass

    assert derives_membership(ShiftRanks())
    assert derives_membership(Compose(ActivateAllRanks(), ShiftRanks()))
    for assignment in (
        FillGaps(),
        Tree([Layer(key_or_fn="job")]),
        MyShift(),
        Compose(ShiftRanks(), FilterCountGroupedByKey(lambda s: 0, lambda c: True)),
    ):
        assert not derives_membership(assignment), assignment


def test_root_cause_skips_faults_derived_from_a_peer():
    entries = [
        {"rank": "1/0.a", "reason": "RuntimeError: Connection closed by peer"},
        {"rank": "2/0.b", "reason": "terminated: process died"},
    ]
    assert P.root_cause(entries) == P.RootCause("2/0.b", "terminated: process died")
    assert P.root_cause(entries[:1]) == P.RootCause("1/0.a", entries[0]["reason"])
    assert P.root_cause([]) is None


# --------------------------------------------------------------------------- completion


def test_completion_outcome():
    assert P.completion_outcome(fault_count=3, baseline=3) == P.COMPLETED
    assert P.completion_outcome(fault_count=4, baseline=3) == P.FAULT


# --------------------------------------------------------------------------- schema and read API


def test_schema():
    role = P.role_namespace("job/g0")
    assert role == "inprocess/job/g0"
    # short (it prefixes every key of a restart), one per role and call
    call = P.call_namespace(role, 2)
    assert call.startswith("ip/") and call.endswith("/2") and len(call) <= 14
    assert call == P.call_namespace("inprocess/job/g0", 2) != P.call_namespace(role, 1)
    assert P.call_namespace(P.role_namespace("job/g1"), 2) != call
    assert P.done_key(P.iteration_key(4, P.TERMINATION)) == "i4/t/d"
    assert P.iteration_of_barrier(f"ip/x/0/{P.barrier_name(12, 3)}/assignment") == 12
    assert P.iteration_of_barrier(P.barrier_name(2, 0)) == 2
    assert P.iteration_of_barrier("ip/x/0/i4/t/assignment") is None
    assert P.split_identities(P.identity_record("0/0.a") + P.identity_record("1/0.b")) == [
        "0/0.a",
        "1/0.b",
    ]
    with pytest.raises(ValueError, match="may not contain"):
        P.identity_record("a,b")


def test_read_api_follows_what_the_store_mixin_writes():
    raw = HashStore()
    role = P.role_namespace("job/g0")
    assert not P.wrapper_present(raw, role) and P.latest_call(raw, role) is None
    raw.announce_call(role, 1)
    raw.announce_call(role, 0)  # a relaunched process passing through call 0: no step back
    assert P.wrapper_present(raw, role) and P.latest_call(raw, role) == 1
    raw.announce_call(role, 2)
    assert P.latest_call(raw, role) == 2

    call = P.call_namespace(role, 2)
    store = PrefixStore(call, raw)
    assert P.membership(raw, call) is None and P.terminated(raw, call) == []
    store.publish_membership(3, ["0/0.a", "1/0.b"])
    store.mark_terminated("1/0.b", "RestartAbort: gave up")
    store.record_fault("0/0.a", "RuntimeError: x")
    store.append(P.FAULT_LOG, "not json\n")
    assert P.membership(raw, call) == P.Membership(3, ("0/0.a", "1/0.b"))
    assert P.terminated(raw, call) == ["1/0.b"]
    log = P.fault_log(raw, call)
    assert [e["rank"] for e in log] == ["1/0.b", "0/0.a"]
    assert P.terminations(log) == {"1/0.b": "terminated: RestartAbort: gave up"}
    assert not P.initial_done(raw, call)


def test_a_listed_death_has_its_reason_in_the_fault_log_already():
    """A decider that sees a death in ``terminated`` finds why in the fault log.

    Every rank logs the root cause of a restart from the fault log as it was when
    the rendezvous decided; a death listed before its reason was logged made some
    ranks log "unknown" for a killed peer.
    """
    seen: list[tuple[list[str], dict[str, str]]] = []

    class WatchedStore(HashStore):
        def append(self, key: str, value: str) -> None:
            super().append(key, value)
            if key == P.TERMINATED:
                seen.append((self.identities(P.TERMINATED), P.terminations(self.fault_log())))

    store = WatchedStore()
    store.mark_terminated("2/0.c", "died")
    assert seen == [(["2/0.c"], {"2/0.c": "terminated: died"})]
    assert store.counter(P.FAULTS) == 1 and store.terminated_epoch() == 1


def test_a_decision_reads_again_until_the_log_has_the_deaths_it_lists():
    """A death logged after the decider read the log but listed before it read the
    list would fault the iteration decided without it a moment later (a spurious
    restart): the decider reads both again."""

    class RacingStore(HashStore):
        raced = False

        def fault_log(self):
            entries = super().fault_log()
            if not self.raced:  # a death between the decider's two reads
                self.raced = True
                self.mark_terminated("1/0.b", "died")
            return entries

    store = RacingStore()
    seen = []

    def decide(arrivals, terminated, baseline):
        seen.append((terminated, baseline))
        return "decided"

    members = ["0/0.a", "1/0.b"]
    store.add_entry(P.arrivals_key("r"), "0/0.a=")
    reads = store._complete("r", members)
    assert reads is not None  # complete without the dead
    store._decide("r", members, decide, reads)
    assert seen == [({"1/0.b"}, 1)]


def test_a_complete_rendezvous_is_decided_from_the_reads_that_found_it_complete():
    """The rank that finds a rendezvous complete read the fault log, the terminated and
    the arrivals, in that order: with no death listed after its log read it decides
    from them (the arrivals, O(N), read once). An incomplete one decides nothing."""

    class Counting(HashStore):
        arrival_reads = 0

        def get(self, key):
            if key.endswith(P.arrivals_key("r")):
                self.arrival_reads += 1
            return super().get(key)

        def entries(self, key):
            if key.endswith(P.arrivals_key("r")):
                self.arrival_reads += 1
            return super().entries(key)

    store = Counting()
    members = ["0/0.a", "1/0.b"]
    store.add_entry(P.arrivals_key("r"), "0/0.a=x")
    assert store._complete("r", members) is None  # 1/0.b neither arrived nor died
    store.add_entry(P.arrivals_key("r"), "1/0.b=y")
    store.record_fault("0/0.a", "boom")
    store.arrival_reads = 0
    reads = store._complete("r", members)
    assert reads is not None
    decision = store._decide("r", members, lambda a, t, b: f"{sorted(a.items())} {t} {b}", reads)
    assert decision == "[('0/0.a', 'x'), ('1/0.b', 'y')] set() 1"
    assert store.arrival_reads == 1


def test_a_death_never_logged_delays_a_decision_boundedly(monkeypatch):
    """A listed death without its fault entry (never written by the protocol, which
    logs first): decided without it after the bound."""
    from inprocess.store import rendezvous as rendezvous_module

    monkeypatch.setattr(rendezvous_module, "COUNTED_WAIT", 0.1)  # where _decide reads it
    store = HashStore()
    store.add_entry(P.TERMINATED, "1/0.b")
    store.add_entry(P.arrivals_key("r"), "0/0.a=")
    members = ["0/0.a", "1/0.b"]
    started = time.monotonic()
    reads = store._complete("r", members)
    assert reads is not None
    decision = store._decide("r", members, lambda a, t, b: f"{sorted(t)} {b}", reads)
    assert decision == "['1/0.b'] 0"
    assert time.monotonic() - started < 5


def test_mark_terminated_counts_the_death_once():
    store = HashStore()
    assert store.mark_terminated("2/0.c", "died")
    assert store.fault_count() == 1 and store.is_terminated("2/0.c")
    assert not store.mark_terminated("2/0.c", "again")  # idempotent
    assert store.fault_count() == 1
