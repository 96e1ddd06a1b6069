"""The restart protocol in one place: its store keys, its decisions and a read API.

Three parts, none of which does any I/O of its own except the read API:

Key schema
    Every key the Wrapper, its monitor process and a job controller share. A
    job's keys live under a *role* namespace ``inprocess/<job namespace>``
    (:func:`role_namespace`); each call of a wrapped function in a process gets
    a short *call* namespace ``ip/<digest of the role>/<k>``
    (:func:`call_namespace`), ``k`` counting the process's calls (every rank of
    a job makes the same sequence of calls). Inside a call namespace: the fault counter and log, the
    terminated and left lists (identities each followed by :data:`SEP`), join
    requests, node heartbeats and placements, the published membership, the wake-up counter
    (``wseq``: wake-ups and deaths, :func:`wake_state`) and its ``w/<k>`` keys,
    and per iteration ``n`` the
    keys under ``i<n>/`` (barrier attempts ``b<k>``, termination ``t``, completion ``c``,
    outcome, exit count, the user's ``env://`` rendezvous, the survivors'
    restart ``phases`` for the restart records of :mod:`inprocess.records`). The role namespace
    holds the ``wrapped`` marker (the role recovers in-process) and
    ``latest_call``, the highest call number any rank has started, so a
    controller follows the call the job is on.

Decisions
    What the rendezvous of :mod:`inprocess.store` agree on, as small frozen
    dataclasses with one codec (:func:`encode`, :func:`decode_membership`,
    :func:`decode_termination`; :class:`Arrival` for the iteration barrier's
    per-rank values), and the pure functions that make them
    (:func:`decide_membership`, :func:`decide_termination`,
    :func:`completion_outcome`, :func:`admitted`). They need no store and no
    process, so they are unit-tested alone. A membership is published as its
    change to the participants every rank holds, with digests each rank
    checks (:func:`encode`, :func:`decode_membership`): what a rank reads per
    restart does not grow with the job. With a rank assignment that keeps
    the survivors in their order (the default), the termination barrier's
    decision carries the fault baseline and the survivors' digest, and every
    rank derives the next membership from it: a restart is one rendezvous,
    not two (:class:`Termination`, :func:`survivors`).

Read API
    What a job controller reads of a running Wrapper job, over any
    ``torch.distributed.Store`` client on the job's store: :func:`wrapper_present`,
    :func:`latest_call`, :func:`initial_done`, :func:`initial_arrivals`,
    :func:`membership`, :func:`join_requests`, :func:`terminated`, :func:`fault_log`.

Every value in the schema is a sealed record (:func:`inprocess.security.seal`,
MAC'd under the job's secret and the key's full name); lists hold one record
per entry. Readers, this module's read API included, use authentic records
only; counters (``faults``, ``te``, barrier counts) only wake
readers. Validators here (:func:`valid_identity`, :meth:`Membership.parse`,
:meth:`Arrival.parse`) turn what a record says into ``None`` rather than an
exception when it is malformed.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from .security import open_records, reject

# --------------------------------------------------------------------------- key schema

#: separator after each identity in the append-only lists (terminated, left, join requests)
SEP = ","
#: root of every key of the Wrapper in a job's store
ROOT = "inprocess"
#: the root of call namespaces (see :func:`call_namespace`)
CALL_ROOT = "ip"

# keys of a role namespace
WRAPPED = "wrapped"
LATEST_CALL = "latest_call"

# keys of a call namespace
FAULTS = "faults"
FAULT_LOG = "fault_log"
TERMINATED = "terminated"
LEFT = "left"
JOIN_REQUESTS = "join_requests"
MEMBERSHIP = "membership"
WAKE_SEQ = "wseq"  # counter of the call's wake-ups and deaths (see wake_state)
FAULT_WAKE = "fw"  # fault wake-ups: see fault_wake_key
NODE_BEAT = "nb"  # a node's heartbeat: nb/<node> (see inprocess.node)
PLACED = "node"  # the node a rank runs on: node/<identity>
HOSTED = "hosted"  # set by a rank that hosts the call's store server
INITIAL = "initial"  # the initial barrier's name
PHASES = "phases"  # per iteration: each survivor's restart phases (one JSON line each)
#: set on a store server that a rank hosts (never on a launcher's), outside any namespace
RANK_HOSTED = "inprocess/rank_hosted"

# outcomes of an iteration
COMPLETED = "completed"
FAULT = "fault"


def role_namespace(job_namespace: str) -> str:
    """The namespace of a job's Wrapper keys (``job_namespace``: see ``store.job_namespace``)."""
    return f"{ROOT}/{job_namespace}"


def call_namespace(role: str, call: int) -> str:
    """The namespace of call ``call`` (0, 1, ...) of the wrapped functions in ``role``.

    Short on purpose: it prefixes every key a rank sends in a restart, and a
    role namespace (a job's, a generation's, the secret's tag) runs to 70
    characters. Its digest names it (48 bits: it only tells apart the roles
    and generations sharing one store; a client that lists keys sees it
    either way, and the records it holds are sealed).
    """
    digest = hashlib.blake2b(role.encode(), digest_size=6).digest()
    return f"{CALL_ROOT}/{base64.urlsafe_b64encode(digest).decode()}/{call}"


def per_identity(kind: str, identity: str) -> str:
    """A per-rank key: ``terminated``, ``completed`` or ``node`` (:data:`PLACED`)
    of ``identity``."""
    return f"{kind}/{identity}"


def node_key(kind: str, node: str) -> str:
    """A per-node key (:data:`NODE_BEAT`)."""
    return f"{kind}/{node}"


def parse_node_beat(record: str | None) -> tuple[int, list[str]]:
    """``(stamp, ranks)`` of a node's heartbeat record; ``(0, [])`` when malformed."""
    stamp, _, ranks = (record or "").partition(" ")
    value = int_or_none(stamp)
    identities = split_identities(ranks)
    if value is None or value < 0 or not all(map(valid_identity, identities)):
        return 0, []
    return value, identities


#: names under an iteration's keys (short: every rank sends them in every restart)
TERMINATION, COMPLETION, OUTCOME = "t", "c", "o"


def iteration_key(iteration: int, name: str) -> str:
    """A key of iteration ``iteration``: :data:`TERMINATION`, :data:`COMPLETION`,
    :data:`OUTCOME`, ``exit``, ``env`` (the user's ``env://`` rendezvous), ``phases``
    or a barrier attempt (:func:`barrier_name`)."""
    return f"i{iteration}/{name}"


def barrier_name(iteration: int, attempt: int) -> str:
    """The iteration barrier's rendezvous of ``iteration``, attempt ``attempt``."""
    return iteration_key(iteration, f"b{attempt}")


_BARRIER_NAME = re.compile(r"(?:^|/)i(\d+)/b\d+(?:/|$)")


def iteration_of_barrier(prefix: str) -> int | None:
    """The iteration of the barrier attempt a key prefix is under, if it is under one."""
    match = _BARRIER_NAME.search(prefix)
    return int(match.group(1)) if match else None


#: what a death adds to :data:`WAKE_SEQ`: one wake-up (the low 32 bits count
#: them) and one death (the high bits). One counter, so a waiter learns both
#: with the one read it makes before it arrives at a barrier.
DEATH_WAKE = (1 << 32) + 1


def wake_state(value: int) -> tuple[int, int]:
    """(wake-ups, deaths) of the call, from a value of :data:`WAKE_SEQ`.

    A stranger may add anything to the counter: a wrong count of deaths only
    makes a waiter read the (sealed) terminated list again, and a wrong count
    of wake-ups only makes it wait on a key that comes late or already exists.
    """
    return value & 0xFFFFFFFF, max(value, 0) >> 32


def wake_key(k: int) -> str:
    """The key the ``k``-th wake-up of a call sets (waiters block on the next one)."""
    return f"w/{k}"


def fault_wake_key(k: int) -> str:
    """The key set by whoever raised the call's fault counter to ``k`` (a fault watch
    blocks on the next one; see ``store.StoreMixin.signal_fault``)."""
    return f"{FAULT_WAKE}/{k}"


# A rendezvous' keys are short: every waiter sends them in every restart.


def done_key(rendezvous: str) -> str:
    """The key where rendezvous (or barrier) ``rendezvous`` publishes its decision."""
    return f"{rendezvous}/d"


def arrivals_key(rendezvous: str) -> str:
    """The list of a rendezvous' arrivals (sealed ``identity=value`` records)."""
    return f"{rendezvous}/a"


def count_key(rendezvous: str) -> str:
    """A rendezvous' counter of arrivals and of deaths counted for members (it wakes)."""
    return f"{rendezvous}/n"


def dead_key(rendezvous: str, identity: str) -> str:
    """The once-key whose winner counts dead member ``identity`` at a rendezvous."""
    return f"{rendezvous}/x/{identity}"


def split_identities(text: str) -> list[str]:
    """The identities of a :data:`SEP`-terminated list, in order."""
    return [item for item in text.split(SEP) if item]


def identity_record(identity: str) -> str:
    """One entry of a :data:`SEP`-terminated list."""
    if SEP in identity:
        raise ValueError(f"an identity may not contain {SEP!r}: {identity!r}")
    return identity + SEP


#: what an identity looks like: ``<initial rank>/<anything without separators>``
_IDENTITY = re.compile(r"[0-9]{1,9}/[A-Za-z0-9_.\-]{1,64}")


def valid_identity(identity: str) -> bool:
    """Whether ``identity`` is well formed (``"<initial rank>/<token>"``, no separators)."""
    return _IDENTITY.fullmatch(identity) is not None


#: a participant's name at a barrier (an identity, or a rank assignment's own token)
_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,100}")


def valid_name(name: str) -> bool:
    """Whether ``name`` can name a barrier participant (no separators, not empty)."""
    return _NAME.fullmatch(name) is not None


def check_identity(identity: str) -> str:
    """``identity``, or a ValueError naming it when it is malformed."""
    if not valid_identity(identity):
        raise ValueError(
            f"an identity is '<initial rank>/<token>' (token: letters, digits, '._-'), "
            f"got {identity!r}"
        )
    return identity


def int_or_none(text: str | None) -> int | None:
    """``text`` as an integer, or ``None`` (absent or not a number)."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def first_or_none(records: Sequence[str]) -> str | None:
    return records[0] if records else None


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A rank's value at the iteration barrier: its new rank, or why it has none.

    ``kind`` is ``"rank"`` (with ``rank``), ``"join"`` (a relaunched process
    admitted by the termination barrier), ``"discard"`` (the rank assignment
    dropped it) or ``"timeout"`` (its rank assignment timed out).
    """

    kind: str
    rank: int = -1

    KINDS = ("rank", "join", "discard", "timeout")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"Arrival.kind must be one of {self.KINDS}, got {self.kind!r}")
        if (self.kind == "rank") != (self.rank >= 0):
            raise ValueError(f"Arrival(kind={self.kind!r}) with rank={self.rank}")

    def encode(self) -> str:
        return str(self.rank) if self.kind == "rank" else self.kind

    @classmethod
    def decode(cls, text: str) -> Arrival:
        return cls("rank", int(text)) if text not in cls.KINDS else cls(text)

    @classmethod
    def parse(cls, text: str) -> Arrival | None:
        """Like :meth:`decode`, ``None`` when malformed."""
        try:
            return cls.decode(text)
        except ValueError:
            return None


JOIN = Arrival("join")
DISCARD = Arrival("discard")
TIMEOUT = Arrival("timeout")


@dataclasses.dataclass(frozen=True)
class Retry:
    """The iteration barrier lost participants before they arrived: try again without them."""

    terminated: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Failed:
    """The iteration barrier cannot form a membership (a bug or a broken rank assignment)."""

    error: str


@dataclasses.dataclass(frozen=True)
class Members:
    """The iteration's membership in rank order, and the fault count it starts from."""

    members: tuple[str, ...]
    baseline: int


MembershipDecision = Retry | Failed | Members


@dataclasses.dataclass(frozen=True)
class RootCause:
    """The fault that started a restart: which rank, which error."""

    rank: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Termination:
    """The termination barrier's decision: who is out, who joins next, and why it restarted.

    With ``baseline`` (the fault count the decider read before the arrivals) and
    ``digest`` (of the members less the terminated, in their order: see
    :func:`survivors`), a rank whose rank assignment keeps the survivors' order
    derives the next membership itself, with no iteration barrier.
    """

    terminated: tuple[str, ...]
    joiners: tuple[str, ...]
    cause: RootCause | None = None
    baseline: int | None = None
    digest: str | None = None


#: characters of the root cause's reason in a termination decision
CAUSE_CHARS = 160


def membership_digest(members: Sequence[str]) -> str:
    """A short digest of an ordered membership: what a rank that derived one checks it with.

    A check against divergence (a bug, a rank's state gone astray), not against
    forgery (the decision that carries it is sealed): a CRC and the count, cheap
    enough for every rank at any N. A :class:`Roster` computes its own once.
    """
    if isinstance(members, Roster):
        return members.digest
    return _digest(members)


def _digest(members: Sequence[str]) -> str:
    return f"{zlib.crc32(chr(10).join(members).encode()):08x}{len(members):08x}"


class Roster(tuple):
    """Identities in rank order: a membership as a rank holds it across restarts.

    Immutable, so what depends only on it is computed once, when first asked
    for: its :attr:`digest` and the members' positions. A restart that changes
    nobody hands a rank the roster it holds again (no O(N) copy, search or
    digest per rank and restart).
    """

    @functools.cached_property
    def digest(self) -> str:
        """:func:`membership_digest` of the roster."""
        return _digest(self)

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {identity: k for k, identity in enumerate(self)}

    def __contains__(self, identity: object) -> bool:
        return identity in self._positions

    def position(self, identity: str, hint: int | None = None) -> int:
        """``identity``'s rank in the roster (``hint``: where it likely is, checked
        first); a ValueError when it is not a member."""
        if hint is not None and 0 <= hint < len(self) and self[hint] == identity:
            return hint
        try:
            return self._positions[identity]
        except KeyError:
            raise ValueError(f"{identity!r} is not a member") from None


def roster(members: Iterable[str]) -> Roster:
    """``members`` as a :class:`Roster` (itself when it is one)."""
    return members if isinstance(members, Roster) else Roster(members)


def survivors(members: Iterable[str], terminated: Iterable[str]) -> Roster:
    """``members`` less ``terminated``, in their order (``members`` itself when none of
    them is terminated: no O(N) work in the common restart)."""
    members = roster(members)
    out = [t for t in terminated if t in members]
    if not out:
        return members
    gone = set(out)
    return Roster(m for m in members if m not in gone)


def launch_token(namespace: str) -> str:
    """The identity token shared by the ranks that start a call together (see
    :func:`launch_identity`): derived from the call's namespace, so every rank
    knows every other's identity without reading it."""
    return hashlib.blake2b(namespace.encode(), digest_size=5).hexdigest()


def initial_rank_of(identity: str) -> int:
    """The initial rank encoded in an identity."""
    return int(identity.split("/", 1)[0])


def incarnation_of(identity: str) -> int:
    """The worker incarnation encoded in an identity (0 outside a launcher)."""
    return int(identity.split("/", 1)[1].split(".", 1)[0])


def _rank_and_incarnation(identity: str) -> tuple[int, int] | None:
    """``(initial rank, incarnation)`` of a well-formed identity, else ``None``."""
    if not valid_identity(identity):
        return None
    rank, _, rest = identity.partition("/")
    incarnation = int_or_none(rest.partition(".")[0])
    return None if incarnation is None else (int(rank), incarnation)


def latest_incarnations(arrivals: Sequence[str]) -> list[str]:
    """The arrivals at a barrier of launched ranks that count: per initial rank, those
    of its newest incarnation, in arrival order.

    A relaunched worker (a newer incarnation of its rank) replaces the arrival its
    predecessor left there, which its barrier timeout or a kill ended; it must not
    count as a second process of the rank. Two arrivals of one incarnation (two
    processes given one ``RANK``) both stay, for the barrier to refuse; so does
    anything that is not an identity.
    """
    newest: dict[int, int] = {}
    for arrival in arrivals:
        parsed = _rank_and_incarnation(arrival)
        if parsed is not None:
            rank, incarnation = parsed
            newest[rank] = max(newest.get(rank, incarnation), incarnation)
    kept = []
    for arrival in arrivals:
        parsed = _rank_and_incarnation(arrival)
        if parsed is None or parsed[1] == newest[parsed[0]]:
            kept.append(arrival)
    return kept


def launch_identity(initial_rank: int, token: str) -> str:
    """The identity of the rank at ``initial_rank`` of a launch (incarnation 0)."""
    return f"{initial_rank}/0.{token}"


#: how a published initial membership starts (no identity starts with it)
INITIAL_HEAD = "#"


def encode_initial(members: Sequence[str], token: str) -> str:
    """The initial membership (ordered by initial rank, ranks 0..N-1) as published.

    Its size, and only the members whose identity is not the launch's own for
    their rank (a worker relaunched before the job started, a rank with an
    identity of its own): what every rank reads does not grow with N.
    """
    others = [m for r, m in enumerate(members) if m != launch_identity(r, token)]
    return f"{INITIAL_HEAD}{len(members)}{SEP}" + "".join(identity_record(m) for m in others)


def decode_initial(text: str, token: str) -> Roster:
    """The initial membership :func:`encode_initial` published; a ValueError when the
    text is not one."""
    head, _, rest = text.partition(SEP)
    size = int_or_none(head.removeprefix(INITIAL_HEAD)) if head.startswith(INITIAL_HEAD) else None
    if size is None or size < 1:
        raise ValueError(f"not an initial membership: {text[:80]!r}")
    return _initial_roster(size, token, tuple(split_identities(rest)))


@functools.lru_cache(maxsize=4)
def _initial_roster(size: int, token: str, others: tuple[str, ...]) -> Roster:
    # Cached: the ranks of one process (or a call made again) share one roster.
    members = [launch_identity(rank, token) for rank in range(size)]
    for identity in others:
        rank = int_or_none(identity.partition("/")[0]) if valid_identity(identity) else None
        if rank is None or not 0 <= rank < size:
            raise ValueError(f"initial membership of {size}: {identity!r} has no rank in it")
        members[rank] = identity
    return Roster(members)


class MembershipMismatch(ValueError):
    """A rank derived another membership than the decider published (a bug, or state that
    diverged between ranks): training on it would pair the wrong peers."""


def encode(
    decision: MembershipDecision | Termination, participants: Sequence[str] | None = None
) -> str:
    """The single-line JSON text of a decision, as published at a rendezvous.

    A :class:`Members` decision with the rendezvous' ``participants`` is
    published as a change to them (O(changes), not O(N), for every reader): the
    participants removed, with digests of the participants it applies to and
    of the result. Only when the decided order is not the participants' own
    (a rank assignment that reorders survivors) is the whole list sent.
    """
    if isinstance(decision, Retry):
        data: dict[str, Any] = {"retry": list(decision.terminated)}
    elif isinstance(decision, Failed):
        data = {"error": decision.error}
    elif isinstance(decision, Members) and participants is not None:
        kept = set(decision.members)
        data = {
            "base": membership_digest(participants),
            "baseline": decision.baseline,
            "digest": membership_digest(decision.members),
        }
        if list(decision.members) == [p for p in participants if p in kept]:
            removed = [p for p in participants if p not in kept]
            if removed:
                data["removed"] = removed
        else:
            data["members"] = list(decision.members)
    elif isinstance(decision, Members):
        data = {"members": list(decision.members), "baseline": decision.baseline}
    elif isinstance(decision, Termination):
        cause = decision.cause
        data = {}
        if decision.terminated:
            data["terminated"] = list(decision.terminated)
        if decision.joiners:
            data["joiners"] = list(decision.joiners)
        if cause is not None:
            # every rank reads it (to log it): the first line's start; the
            # fault log keeps the whole text for the report
            data["cause"] = {"rank": cause.rank, "reason": cause.reason[:CAUSE_CHARS]}
        if decision.baseline is not None:
            data["baseline"] = decision.baseline
        if decision.digest is not None:
            data["digest"] = decision.digest
    else:
        raise TypeError(f"not a decision of the protocol: {decision!r}")
    # Compact (every rank reads it in every restart); empty fields are left out.
    return json.dumps(data, separators=(",", ":"))


def decode_membership(text: str, participants: Sequence[str] | None = None) -> MembershipDecision:
    """The decision published at an iteration barrier; a change to ``participants`` is
    applied and checked against its digests.

    Raises:
        MembershipMismatch: this rank's participants, or what it derived from
            them, differ from the decider's.
    """
    data = json.loads(text)
    if "retry" in data:
        return Retry(tuple(data["retry"]))
    if "error" in data:
        return Failed(str(data["error"]))
    if "digest" not in data:
        return Members(Roster(data["members"]), int(data["baseline"]))
    if participants is None:
        raise ValueError("a membership published as a change needs the participants")
    if "members" in data:
        members = Roster(data["members"])
    elif "removed" in data:
        removed = set(data["removed"])
        members = Roster(p for p in participants if p not in removed)
    else:
        members = roster(participants)
    # One digest per rank in the common case: a result derived from other
    # participants fails the result's check (the base then says why). A whole
    # list (rare: a reordering assignment) is not derived: the base is checked.
    derived = membership_digest(members)
    if "members" in data or derived != data["digest"]:
        if data["base"] != membership_digest(participants):
            raise MembershipMismatch(
                f"this rank's {len(participants)} participants differ from those the decider "
                f"applied its change to (digest {membership_digest(participants)} != "
                f"{data['base']})"
            )
    if derived != data["digest"]:
        raise MembershipMismatch(
            f"the membership this rank derived ({len(members)} members, digest "
            f"{derived}) is not the decider's (digest {data['digest']})"
        )
    return Members(members, int(data["baseline"]))


def decode_termination(text: str) -> Termination:
    data = json.loads(text)
    cause = data.get("cause")
    baseline, digest = data.get("baseline"), data.get("digest")
    return Termination(
        tuple(data.get("terminated", ())),
        tuple(data.get("joiners", ())),
        None if cause is None else RootCause(str(cause["rank"]), str(cause["reason"])),
        None if baseline is None else int(baseline),
        None if digest is None else str(digest),
    )


def _initial_rank(identity: str) -> int:
    return int(identity.split("/", 1)[0])


def _joiner_order(identity: str) -> tuple[int, str]:
    return _initial_rank(identity), identity


def decide_membership(
    arrivals: dict[str, Arrival],
    terminated: set[str],
    baseline: int,
    join_requests: Sequence[str],
    gone: set[str],
) -> MembershipDecision:
    """The iteration barrier's decision: the ordered membership, or a retry.

    ``arrivals`` are the arrived participants' values, ``terminated`` the
    participants terminated (arrived or not), ``baseline`` the fault count read
    before them; ``join_requests`` and ``gone`` (terminated or left anywhere in
    the call) are read after. A join request not admitted yet counts as an
    unhandled fault (the baseline is lowered by one), so the new iteration
    restarts at once and admits it: the request may have come too late for the
    termination barrier, and its fault may already be part of ``baseline``.
    """
    if terminated:
        return Retry(tuple(sorted(terminated)))
    timed_out = sorted(i for i, v in arrivals.items() if v.kind == "timeout")
    if timed_out:
        return Failed(f"rank assignment timed out on {timed_out}")
    slots: dict[int, str] = {}
    admitted = []
    for identity, value in arrivals.items():
        if value.kind == "discard":
            continue
        if value.kind == "join":
            admitted.append(identity)
            continue
        if value.rank in slots:
            return Failed(f"rank {value.rank} assigned to both {slots[value.rank]} and {identity}")
        slots[value.rank] = identity
    if sorted(slots) != list(range(len(slots))):
        return Failed(f"assigned ranks {sorted(slots)} have gaps")
    members = [slots[r] for r in range(len(slots))]
    members += sorted(admitted, key=_joiner_order)
    if not members:
        return Failed("no rank is left")
    if any(j not in members and j not in gone for j in join_requests):
        baseline -= 1
    return Members(tuple(members), baseline)


#: texts of errors that a rank's collective raises because of a peer's fault
DERIVED_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
)


def derived(reason: str) -> bool:
    """Whether a recorded fault reads as the consequence of another rank's fault."""
    return any(text in reason for text in DERIVED_ERRORS)


def root_cause(entries: Sequence[dict[str, Any]]) -> RootCause | None:
    """The fault that started a restart, from the iteration's fault log entries in order.

    The first one that is not a communication error: a survivor's "Connection
    closed by peer" is derived, and may be recorded before the death that
    caused it (which the dead rank's monitor process records).
    """
    primary = [e for e in entries if not derived(str(e.get("reason", "")))]
    root = (primary or list(entries) or [None])[0]
    return None if root is None else RootCause(str(root["rank"]), str(root["reason"]))


def decide_termination(
    terminated: set[str],
    members: Sequence[str],
    join_requests: Sequence[str],
    gone: set[str],
    cause: RootCause | None,
    baseline: int | None = None,
) -> Termination:
    """The termination barrier's decision: the terminated members, and the join
    requests of processes neither members, terminated nor gone, by initial rank.

    With the fault ``baseline`` the decider read, the decision also carries the
    digest of the survivors: enough for a rank to derive the next membership
    itself (see :class:`Termination`)."""
    joiners = sorted(
        (j for j in join_requests if j not in members and j not in gone), key=_joiner_order
    )
    digest = None if baseline is None else survivors(members, terminated).digest
    return Termination(tuple(sorted(terminated)), tuple(joiners), cause, baseline, digest)


def completion_outcome(fault_count: int, baseline: int) -> str:
    """What the last rank at the completion barrier proposes: a fault recorded
    since the iteration was decided wins over completion."""
    return FAULT if fault_count > baseline else COMPLETED


def admitted(decision: Termination, identity: str) -> bool:
    """Whether a termination decision admits the joining process ``identity``."""
    return identity in decision.joiners


# --------------------------------------------------------------------------- read API


def wrapper_present(store: Any, role: str) -> bool:
    """Whether a Wrapper has started a call in ``role`` (the role recovers in-process)."""
    return bool(_records(store, f"{role}/{WRAPPED}"))


def latest_call(store: Any, role: str) -> int | None:
    """The highest call number a rank of ``role`` has started; ``None`` before the first."""
    return int_or_none(first_or_none(_records(store, f"{role}/{LATEST_CALL}")))


def initial_done(store: Any, call_ns: str) -> bool:
    """Whether the initial barrier of the call completed (a new process there is a joiner)."""
    return bool(_records(store, f"{call_ns}/{done_key(INITIAL)}"))


@dataclasses.dataclass(frozen=True)
class Membership:
    """The latest membership a call published: its iteration and members in rank order."""

    iteration: int
    members: tuple[str, ...]

    def encode(self) -> str:
        return json.dumps({"iteration": self.iteration, "members": list(self.members)})

    @classmethod
    def decode(cls, text: str) -> Membership:
        data = json.loads(text)
        return cls(int(data["iteration"]), tuple(data["members"]))

    @classmethod
    def parse(cls, text: str | None, key: str = MEMBERSHIP) -> Membership | None:
        """Like :meth:`decode`; ``None`` when absent or malformed (logged once for ``key``)."""
        parsed = _iteration_identities(text, "members", key, "a malformed membership")
        return None if parsed is None else cls(*parsed)


def _iteration_identities(
    text: str | None, field: str, key: str, what: str
) -> tuple[int, tuple[str, ...]] | None:
    """``(iteration, identities)`` of a record ``{"iteration": n, field: [...]}``;
    ``None`` when absent or malformed (logged once for ``key`` as ``what``)."""
    if text is None:
        return None
    try:
        data = json.loads(text)
        iteration, names = int(data["iteration"]), tuple(data[field])
    except (ValueError, KeyError, TypeError):
        names = None
    if names is None or not all(isinstance(n, str) and valid_identity(n) for n in names):
        reject(key, what)
        return None
    return iteration, names


def ring_successors(
    members: Sequence[str], identity: str, count: int, hint: int | None = None
) -> list[str]:
    """The ``count`` members after ``identity`` in ring order (the peers it watches);
    ``hint``: where ``identity`` likely is."""
    if identity not in members or len(members) < 2:
        return []
    index = roster(members).position(identity, hint)
    n = len(members)
    return [members[(index + k) % n] for k in range(1, min(count, n - 1) + 1)]


@dataclasses.dataclass(frozen=True)
class Peers:
    """The peers a rank's monitor process watches in an iteration: handed over by the
    rank on its progress board, so the monitor reads nothing from the store for it."""

    iteration: int
    peers: tuple[str, ...]

    def encode(self) -> str:
        return json.dumps({"iteration": self.iteration, "peers": list(self.peers)})

    @classmethod
    def parse(cls, text: str | None, key: str = "board") -> Peers | None:
        """``None`` when absent or malformed (logged once for ``key``)."""
        parsed = _iteration_identities(text, "peers", key, "malformed peers")
        return None if parsed is None else cls(*parsed)


def _records(store: Any, key: str) -> list[str]:
    """The authentic records at ``key`` of an unprefixed client."""
    return open_records(key, store.get(key) if store.check([key]) else None)


def membership(store: Any, call_ns: str) -> Membership | None:
    key = f"{call_ns}/{MEMBERSHIP}"
    return Membership.parse(first_or_none(_records(store, key)), key)


def terminated(store: Any, call_ns: str) -> list[str]:
    """The identities the call declared terminated, in order."""
    return [i for i in _records(store, f"{call_ns}/{TERMINATED}") if valid_identity(i)]


def join_requests(store: Any, call_ns: str) -> list[str]:
    """The identities that asked to join the call, in order."""
    return [i for i in _records(store, f"{call_ns}/{JOIN_REQUESTS}") if valid_identity(i)]


def initial_arrivals(store: Any, call_ns: str) -> list[str]:
    """The identities that arrived at the call's initial barrier, in order (every
    incarnation of a rank that arrived, see :func:`latest_incarnations`)."""
    key = f"{call_ns}/{arrivals_key(INITIAL)}"
    found = (entry.partition("=")[0] for entry in _records(store, key))
    return [i for i in found if valid_identity(i)]


def fault_entry(identity: str, reason: str, time: float) -> str:
    """One line of the fault log."""
    return json.dumps({"rank": identity, "reason": reason[:500], "time": time}) + "\n"


def parse_fault_log(text: str) -> list[dict[str, Any]]:
    """The entries of a fault log (``rank``, ``reason``, ``time``); unreadable lines are skipped."""
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("rank"), str)
            and isinstance(entry.get("reason"), str)
        ):
            entries.append(entry)
    return entries


def parse_phases(text: str) -> dict[str, dict[str, Any]]:
    """The survivors' restart phases of an iteration (its :data:`PHASES` key), by identity;
    unreadable lines are skipped."""
    phases: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "rank" in entry:
            phases.setdefault(str(entry["rank"]), entry)
    return phases


def fault_log(store: Any, call_ns: str) -> list[dict[str, Any]]:
    return parse_fault_log("\n".join(_records(store, f"{call_ns}/{FAULT_LOG}")))


def terminations(entries: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The first reason recorded for each rank declared terminated (``"terminated: ..."``)."""
    reasons: dict[str, str] = {}
    for entry in entries:
        reason = str(entry["reason"])
        if reason.startswith(TERMINATED_PREFIX):
            reasons.setdefault(str(entry["rank"]), reason)
    return reasons


#: prefix of the fault log reason of a rank declared terminated
TERMINATED_PREFIX = "terminated: "
