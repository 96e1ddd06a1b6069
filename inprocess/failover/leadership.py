"""Coordinator election under an etcd lease, and writes conditioned on the term.

Every launcher of a multi-machine job (``--rdzv-backend etcd``) is a candidate
coordinator. They do not elect anyone themselves: etcd decides. A candidate
grants itself a lease and puts its *leader record* under
``/inprocess/<job>/leader`` in a transaction that succeeds only if the key is
absent; the one whose transaction succeeds leads, for as long as its lease
lives. Its *term* is the revision of that put (the key's ``mod_revision``):
etcd's revisions only grow, so a later leader always has a larger term.

Every decision of the leader (each save of the controller's state) is a
*guarded write* (:meth:`Election.guarded_put`): a transaction that compares the
leader key's ``mod_revision`` with the term and its lease with the leader's
lease. A leader whose lease expired (its machine froze, its network was cut)
may still believe it leads for a moment, but its writes fail: the key was
deleted with the lease, or a newer leader put it again.

Security: etcd may be reachable by clients that are not processes of the job.
The leader record (identity, endpoint, lease id, as JSON) is sealed with the
job's secret (:func:`inprocess.security.seal`, bound to the key's name), and a
reader accepts it only if the MAC verifies and the key's actual lease is the
lease named inside. A stranger can neither forge a record nor replay a genuine
one without its live lease, so it cannot become coordinator nor send agents to
its own endpoint. A record that does not verify counts as no leader: a
candidate replaces it, in a transaction conditioned on that key's
``mod_revision`` (never blindly). A stranger that can write to etcd can still
deny service (delete keys, rewrite the leader key with the leader's lease),
which ends leaderships, never hands one out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable

from .. import security
from .etcd import Compare, Etcd, EtcdError, EtcdUnavailable, KeyValue, Op
from .spec import JOB_ID_PATTERN

__all__ = ["Election", "KeyExistsError", "Leader", "NotLeader", "job_prefix"]

log = logging.getLogger(__name__)

#: the longest a retry of a write waits between tries while etcd does not answer
RETRY_INTERVAL = 0.25


class NotLeader(Exception):
    """A guarded write found a newer term, or this candidate's lease is gone: stand down."""


class KeyExistsError(Exception):
    """A guarded create found the key present; ``existing`` is what it holds."""

    def __init__(self, message: str, existing: KeyValue) -> None:
        super().__init__(message)
        self.existing = existing


@dataclasses.dataclass(frozen=True)
class Leader:
    """The authentic leader of a job, as read from etcd.

    Attributes:
        identity: who leads (e.g. ``"<hostname>/<pid>/<nonce>"``).
        endpoint: ``"host:port"`` where its coordinator listens.
        term: the etcd revision at which this leadership began (the leader
            key's ``mod_revision``); a later leadership has a larger one.
        lease: the etcd lease the leadership lives under.
    """

    identity: str
    endpoint: str
    term: int
    lease: int


def job_prefix(job: str) -> str:
    """Where a job's keys live in etcd: ``/inprocess/<job>/``."""
    return f"/inprocess/{job}/"


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"Election {name} must be a non-empty printable string, got {value!r}")
    return value


class Election:
    """One candidate coordinator of job ``job``.

    Args:
        etcd: the client (not closed by this object).
        job: the job's id (letters, digits, ``_ . -``); keys live under
            ``/inprocess/<job>/``.
        identity: who this candidate is, unique among the job's candidates.
        endpoint: ``"host:port"`` where this candidate's coordinator listens
            once it leads.
        secret: the job's secret; records are sealed with it.
        ttl: seconds the lease lives without renewal (at least 2): how long a
            frozen leader blocks a successor. Renewed every ``ttl / 3``.
        on_lost: called once, from the keepalive thread, when a won leadership
            is lost (etcd says the lease is gone, or it was not renewed in time
            though etcd answered, or a guarded write found a newer term); not
            on :meth:`resign`. While etcd does not answer at all (no quorum)
            the leadership is not taken for lost: nobody can be elected then,
            and etcd renews the leases once its quorum is back.

    Invariants:

    * At most one candidate leads *for writes* at any time: every guarded
      write is conditioned in etcd on the term and lease of the leader key, so
      a stale leader's write fails even while it still believes it leads.
    * The term only grows: it is an etcd revision of a successful put of the
      leader key, and etcd's revisions never decrease.
    * ``on_lost`` is called at most once per won campaign: only that campaign's
      keepalive thread calls it (``_report_lost``), after taking the lease
      away under the lock, and a thread ends once it did.
    """

    def __init__(
        self,
        etcd: Etcd,
        job: str,
        identity: str,
        endpoint: str,
        secret: str,
        ttl: int = 3,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(job, str) or not JOB_ID_PATTERN.fullmatch(job) or job in (".", ".."):
            raise ValueError(
                f"Election job must be a non-empty string of letters, digits, '_', '.' or '-' "
                f"(not '.' or '..'), got {job!r}"
            )
        self.identity = _check_text("identity", identity)
        self.endpoint = _check_text("endpoint", endpoint)
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"Election endpoint must be 'host:port', got {endpoint!r}")
        if not isinstance(secret, str) or len(secret) < security.MIN_SECRET_LENGTH:
            raise ValueError(
                f"Election secret must be a string of at least {security.MIN_SECRET_LENGTH} "
                "characters (the job's secret)"
            )
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 2:
            raise ValueError(f"Election ttl must be an integer number of seconds >= 2, got {ttl!r}")
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"Election on_lost must be callable or None, got {on_lost!r}")
        self.etcd = etcd
        self.job = job
        self.prefix = job_prefix(job)
        self.leader_key = self.prefix + "leader"
        self.ttl = ttl
        self._secret = secret
        self._on_lost = on_lost

        self._lock = threading.Lock()
        # -- guarded by _lock ---------------------------------------------
        #: the lease of the current campaign or leadership (None: none held)
        self._lease: int | None = None
        #: the term of the won leadership; None when not leading
        self._term: int | None = None
        #: monotonic time by which the lease surely expired unless renewed since
        self._expires_at = 0.0
        #: the current leadership was lost (set once per won campaign), and why
        self._lost = False
        self._lost_reason = ""
        #: mod_revision of each key as this candidate last wrote or read it
        self._revisions: dict[str, int] = {}
        # -------------------------------------------------------------------
        #: wakes the keepalive thread (resign, or a loss found by a write)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: test hook: while set, the keepalive thread does nothing at all, as
        #: on a frozen machine (no renewal, no loss detected by it)
        self._frozen = threading.Event()
        #: writes under a leadership another process of this identity holds
        #: (:meth:`follow`): the lease is neither renewed nor revoked here
        self._following = False

    def __repr__(self) -> str:
        return (
            f"Election(job={self.job!r}, identity={self.identity!r}, term={self.term!r}, "
            f"leading={self.is_leader()})"
        )

    @property
    def secret(self) -> str:
        """The job's secret the records are sealed with."""
        return self._secret

    # -- reading the leader ---------------------------------------------------

    def _record(self, lease: int) -> bytes:
        text = json.dumps(
            {"identity": self.identity, "endpoint": self.endpoint, "lease": lease},
            sort_keys=True,
        )
        return security.seal(self.leader_key, text, self._secret).encode()

    def _authentic(self, kv: KeyValue | None) -> Leader | None:
        """The leader ``kv`` names if it is authentic: sealed with the secret,
        and the key's actual lease is the one named inside."""
        if kv is None:
            return None
        text = security.open_first(self.leader_key, kv.value, self._secret)
        if text is None:
            return None
        try:
            data = json.loads(text)
            identity, endpoint, lease = data["identity"], data["endpoint"], data["lease"]
        except (ValueError, TypeError, KeyError):
            security.reject(self.leader_key, "a sealed leader record of the wrong form")
            return None
        if not (isinstance(identity, str) and isinstance(endpoint, str)):
            return None
        if isinstance(lease, bool) or not isinstance(lease, int) or lease == 0:
            return None
        if kv.lease != lease:
            # a genuine record replayed without its live lease
            security.reject(self.leader_key, "a leader record without its lease (a replay?)")
            return None
        return Leader(identity=identity, endpoint=endpoint, term=kv.mod_revision, lease=lease)

    def leader(self) -> Leader | None:
        """The job's current authentic leader, or None (no leader, or a record
        that does not verify). Raises :class:`EtcdError` when etcd does not answer."""
        return self._authentic(self.etcd.get(self.leader_key))

    # -- leading ----------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether this candidate leads: it won, has not resigned or lost, and
        its lease cannot have expired yet by its own clock."""
        with self._lock:
            return self._term is not None and not self._lost and time.monotonic() < self._expires_at

    @property
    def term(self) -> int | None:
        """The term of the current leadership; None when not leading."""
        with self._lock:
            return None if self._lost else self._term

    def _ensure_lease(self) -> int:
        """A live lease of this candidate (renewed now, or granted); sets ``_expires_at``."""
        with self._lock:
            lease = self._lease
        if lease is not None:
            sent = time.monotonic()
            left = self.etcd.lease_keepalive(lease)
            if left > 0:
                with self._lock:
                    self._expires_at = sent + left
                return lease
        sent = time.monotonic()
        lease = self.etcd.lease_grant(self.ttl)
        with self._lock:
            self._lease = lease
            self._expires_at = sent + self.ttl
        return lease

    def _try_once(self) -> int | None:
        """One attempt to lead; the term when won."""
        kv = self.etcd.get(self.leader_key)
        current = self._authentic(kv)
        if current is not None:
            with self._lock:
                mine = current.lease == self._lease
            if not mine:
                return None
            # ours: an earlier attempt won though its answer was lost; renewed
            # now so that the leadership starts with a full lease
            return current.term if self._ensure_lease() == current.lease else None
        lease = self._ensure_lease()
        if kv is None:
            compare = [Compare.create_revision(self.leader_key, "=", 0)]
        else:
            # not authentic: replaced, but only as it was read (never blindly)
            compare = [Compare.mod_revision(self.leader_key, "=", kv.mod_revision)]
            log.warning(
                "replacing the leader key %s of job %s: it holds no authentic record",
                self.leader_key,
                self.job,
            )
        result = self.etcd.txn(compare, [Op.put(self.leader_key, self._record(lease), lease)])
        return result.revision if result.succeeded else None

    def campaign(self, timeout: float | None = None, stop: threading.Event | None = None) -> Leader:
        """Blocks until this candidate leads; returns the leadership.

        Polls every ``ttl / 6`` while another candidate leads, and retries while
        etcd does not answer (logged once). Once won, a daemon thread renews the
        lease every ``ttl / 3``.

        Raises:
            TimeoutError: ``timeout`` seconds passed, or ``stop`` was set.
            RuntimeError: this candidate already leads.
        """
        if self.is_leader():
            raise RuntimeError(f"{self!r} already leads; resign() before campaigning again")
        self._join_keepalive()
        with self._lock:
            self._term = None
            self._lost = False
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self.ttl / 6
        unavailable = False
        won = False
        try:
            while True:
                if stop is not None and stop.is_set():
                    raise TimeoutError(f"campaign of {self.identity} for job {self.job} stopped")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.identity} did not become the leader of job {self.job} within "
                        f"{timeout} s"
                    )
                try:
                    term = self._try_once()
                except EtcdUnavailable as ex:
                    if not unavailable:
                        log.warning("campaign for job %s: etcd does not answer (%s)", self.job, ex)
                    unavailable = True
                    term = None
                else:
                    if unavailable:
                        log.info("campaign for job %s: etcd answers again", self.job)
                    unavailable = False
                if term is not None:
                    won = True
                    break
                wait = (
                    poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
                )
                if stop is not None:
                    stop.wait(wait)
                else:
                    time.sleep(wait)
        finally:
            if not won:
                self._drop_lease()
        with self._lock:
            self._term = term
            self._lost = False
            lease = self._lease
            self._wake.clear()
            thread = threading.Thread(
                target=self._keepalive,
                args=(lease,),
                name=f"inprocess-election-{self.job}",
                daemon=True,
            )
            self._thread = thread
        assert lease is not None
        thread.start()
        log.info("%s leads job %s: term %d, lease %x", self.identity, self.job, term, lease)
        return Leader(self.identity, self.endpoint, term, lease)

    def follow(self, timeout: float = 0.0) -> Leader:
        """Writes under the leadership of this candidate's identity that another
        process holds: the launcher that won keeps the lease alive, the
        coordinator process it started makes the guarded writes
        (:mod:`.etcd_member`). Takes on the current term and lease, never renews
        nor revokes them; called again after :class:`NotLeader`, it takes on a
        term the same identity won since (waiting up to ``timeout`` seconds for
        it to lead).

        Raises:
            NotLeader: another identity leads, or this one does not within ``timeout``.
            EtcdError: etcd did not answer.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None and leader.identity == self.identity:
                with self._lock:
                    self._following = True
                    self._lease, self._term, self._lost = leader.lease, leader.term, False
                    self._expires_at = math.inf  # (the holder's to renew, not ours)
                return leader
            if leader is not None or time.monotonic() >= deadline:
                with self._lock:
                    self._term = None
                raise NotLeader(
                    f"{self.identity} does not lead job {self.job}"
                    + (f": {leader.identity} does (term {leader.term})" if leader else "")
                )
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))

    def _keepalive(self, lease: int) -> None:
        """Renews ``lease`` every ttl/3 until resigned or lost; reports a loss once."""
        interval = self.ttl / 3
        reason = None
        # Set while etcd does not answer a renewal: the lease then is etcd's to
        # end, not our clock's. Without a quorum nobody can be elected, and etcd
        # renews every lease when a quorum is back; a quorum that we cannot
        # reach may elect another, whose term makes our writes fail in etcd, and
        # we learn it ("lease gone") once etcd answers us again.
        unanswered_since: float | None = None
        while True:
            with self._lock:
                if self._lease != lease or self._term is None:
                    return  # resigned
                if self._lost:
                    reason = self._lost_reason
                    break
                left = self._expires_at - time.monotonic()
            if left <= 0 and unanswered_since is None:
                reason = "its lease was not renewed in time"
                break
            self._wake.wait(min(interval, left) if left > 0 else interval)
            self._wake.clear()
            while self._frozen.is_set():  # test hook: a frozen machine
                time.sleep(0.01)
            with self._lock:
                if self._lease != lease or self._term is None or self._lost:
                    continue
            sent = time.monotonic()
            try:
                ttl_left = self.etcd.lease_keepalive(lease)
            except EtcdUnavailable as ex:
                if unanswered_since is None:
                    unanswered_since = sent
                    log.warning(
                        "etcd does not answer (%s): the lease of job %s is not renewed; its "
                        "coordinator goes on, its decisions wait for etcd",
                        ex,
                        self.job,
                    )
                continue
            except EtcdError as ex:
                log.debug("renewing lease %x of job %s failed: %s", lease, self.job, ex)
                continue
            if unanswered_since is not None:
                log.info(
                    "etcd answers again after %.1f s: the lease of job %s %s",
                    time.monotonic() - unanswered_since,
                    self.job,
                    "is renewed" if ttl_left > 0 else "is gone",
                )
                unanswered_since = None
            if ttl_left <= 0:
                reason = "its lease is gone"
                break
            with self._lock:
                if self._lease == lease:
                    self._expires_at = max(self._expires_at, sent + ttl_left)
        self._report_lost(lease, reason)

    def _mark_lost(self, lease: int | None, reason: str) -> bool:
        """Marks the leadership under ``lease`` lost; whether this call did it."""
        with self._lock:
            if lease is None or self._lease != lease or self._term is None or self._lost:
                return False
            self._lost = True
            self._lost_reason = reason
        self._wake.set()
        return True

    def _report_lost(self, lease: int, reason: str) -> None:
        """Called by the keepalive thread only: ``on_lost`` once per won campaign."""
        self._mark_lost(lease, reason)
        with self._lock:
            if self._lease != lease:
                return  # resigned meanwhile: nothing to report
            term = self._term
            self._lease = None
        log.warning(
            "%s lost the leadership of job %s (term %s): %s", self.identity, self.job, term, reason
        )
        self._revoke(lease)  # best effort: a successor need not wait for the expiry
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost of the election of job %s failed", self.job)

    # -- guarded writes -----------------------------------------------------------

    def guarded_put(
        self, key: str, value: bytes | str, *, create: bool = False, deadline: float | None = None
    ) -> int:
        """Writes ``key`` only while this candidate leads; returns the write's revision.

        One transaction compares the leader key's ``mod_revision`` with the term
        and its lease with ours, and ``key``'s ``mod_revision`` with the one
        this candidate last saw: a stale leader's write fails in etcd, and a
        retry after an answer lost in transit never writes twice (the first
        write changed the revision; the retry finds the value in place).

        While etcd does not answer (its quorum lost) the write is retried until
        it does (a warning when the wait starts, an info when it ends), unless
        the leadership is lost meanwhile, or ``deadline`` (a
        :func:`time.monotonic` time; None: none) passes.

        Args:
            create: the key must be absent (:class:`KeyExistsError` otherwise).

        Raises:
            NotLeader: not leading, or the leadership was lost (newer term, lease gone).
            KeyExistsError: ``create`` and the key exists.
            TimeoutError: ``deadline`` passed while etcd did not answer.
        """
        data = value.encode() if isinstance(value, str) else bytes(value)
        if not isinstance(key, str) or not key.startswith(self.prefix) or key == self.leader_key:
            raise ValueError(
                f"guarded_put key must be under {self.prefix} and not the leader key, got {key!r}"
            )
        waiting_since: float | None = None
        try:
            while True:
                with self._lock:
                    term, lease, lost = self._term, self._lease, self._lost
                    known = 0 if create else self._revisions.get(key)
                if term is None or lease is None or lost:
                    raise NotLeader(f"{self.identity} does not lead job {self.job}")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"etcd did not answer a write of {key} in time")
                try:
                    revision = self._put_once(key, data, term, lease, known, create)
                except EtcdUnavailable as ex:
                    if waiting_since is None:
                        waiting_since = time.monotonic()
                        log.warning(
                            "etcd does not answer (%s); the write of %s waits for it", ex, key
                        )
                    with self._lock:
                        expired = time.monotonic() >= self._expires_at
                    if expired:
                        # the keepalive thread reports it
                        self._mark_lost(lease, "its lease was not renewed in time")
                        continue
                    self._wake_wait(RETRY_INTERVAL, deadline)
                    continue
                if revision is None:
                    continue  # the key's revision was refreshed: try again
                return revision
        finally:
            if waiting_since is not None:
                log.info(
                    "the write of %s waited %.1f s for etcd", key, time.monotonic() - waiting_since
                )

    def _wake_wait(self, seconds: float, deadline: float | None) -> None:
        if deadline is not None:
            seconds = max(0.0, min(seconds, deadline - time.monotonic()))
        time.sleep(seconds)

    def _put_once(
        self, key: str, data: bytes, term: int, lease: int, known: int | None, create: bool
    ) -> int | None:
        """One guarded transaction; the revision written, or None to try again."""
        if known is None:
            current = self.etcd.get(key)
            known = 0 if current is None else current.mod_revision
        compare = [
            Compare.mod_revision(self.leader_key, "=", term),
            Compare.lease(self.leader_key, "=", lease),
            Compare.mod_revision(key, "=", known),
        ]
        result = self.etcd.txn(compare, [Op.put(key, data)], [Op.get(self.leader_key), Op.get(key)])
        if result.succeeded:
            with self._lock:
                self._revisions[key] = result.revision
            return result.revision
        leader_kvs, key_kvs = result.responses
        head = leader_kvs[0] if leader_kvs else None
        if head is None or head.mod_revision != term or head.lease != lease:
            self._mark_lost(lease, "a guarded write found a newer term")
            raise NotLeader(
                f"{self.identity} no longer leads job {self.job}: the leader key "
                + ("is gone" if head is None else f"has term {head.mod_revision}, ours {term}")
            )
        kv = key_kvs[0] if key_kvs else None
        if kv is not None and kv.value == data:
            # an earlier try was applied though its answer was lost (the client
            # fails over after a timeout, and etcd may apply what timed out):
            # done, not written twice. Only the leader writes the job's keys, so
            # the value is ours (or a replay of ours: the same bytes).
            with self._lock:
                self._revisions[key] = kv.mod_revision
            return kv.mod_revision
        if create and kv is not None:
            raise KeyExistsError(f"{key} exists", kv)
        if kv is not None and self._following:
            # a term of ours that ended and came back: what another leader wrote
            # meanwhile is not ours to overwrite
            self._mark_lost(lease, "another leadership wrote the key")
            raise NotLeader(
                f"{key} was changed under another leadership (revision {kv.mod_revision})"
            )
        if kv is not None:
            log.warning(
                "%s was changed by someone else (revision %d); overwriting it", key, kv.mod_revision
            )
        with self._lock:
            self._revisions[key] = 0 if kv is None else kv.mod_revision
        return None

    # -- ending -------------------------------------------------------------------

    def _revoke(self, lease: int) -> None:
        if self._following:
            return  # the lease is its holder's
        try:
            self.etcd.lease_revoke(lease)
        except EtcdError as ex:
            log.info(
                "revoking lease %x of job %s failed (it expires by itself): %s", lease, self.job, ex
            )

    def _drop_lease(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self._revoke(lease)

    def resign(self) -> None:
        """Gives up the leadership (or the campaign's lease): revokes the lease,
        so the leader key goes, and stops the keepalive thread. Idempotent."""
        with self._lock:
            lease, term = self._lease, self._term
            self._lease = None
            self._term = None
        self._wake.set()
        if lease is not None:
            self._revoke(lease)
            if term is not None:
                log.info(
                    "%s resigned the leadership of job %s (term %d)", self.identity, self.job, term
                )

    def _join_keepalive(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._wake.set()
            thread.join()
            self._thread = None

    def close(self) -> None:
        """:meth:`resign` and wait for the keepalive thread to end."""
        self.resign()
        self._frozen.clear()
        self._join_keepalive()
