"""A launcher of a job whose coordinator etcd elects (``--rdzv-backend etcd``).

Every machine's ``inprocess-run`` is this machine's node agent (as under any
coordinator: :mod:`.node_agent`) and a candidate coordinator. The candidates
campaign through etcd (:class:`.leadership.Election`); the one elected runs the
job's coordinator (controller and store, no workers: ``inprocess-run
--coordinator-only`` in a process of its own, handed this launcher's listening
socket), and publishes where it listens in its sealed leader record. Every
agent, the leader's own included, finds the coordinator there, never at a
fixed address.

The coordinator keeps the job's state in etcd (:class:`.etcd_state.EtcdStateStore`),
each save conditioned on the leader's term: a coordinator whose lease expired
(its machine frozen) cannot write over a decision taken after it. Its
controller does not hold the lease (the launcher does, it lives as long as the
machine's part in the job); it writes under the leadership of its launcher's
identity (:meth:`.leadership.Election.follow`).

Every launcher campaigns for as long as it serves the job. When the leader's
lease ends (its machine lost or frozen), another launcher is elected and its
coordinator *takes the job over*: no rendezvous; the job's state and who holds
which node slot come from etcd; its controller starts as after a crash of its
own (``--recover``), the agents reconnect to it with their workers, and a
machine that does not come back is lost like any other. The store went with
the old coordinator's machine, so the job restarts cold (a new generation, its
state from persisted snapshots). A coordinator that finds another launcher
leading (its machine was frozen, and is back) is ended by its launcher: it
stands down.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from ..security import JOB_SECRET_ENV, open_first, seal
from .backends.nodes import NodesConfig
from .cluster_env import MultiNodeArgs
from .etcd import Etcd, EtcdError, EtcdUnavailable
from .etcd_state import EtcdStateStore
from .leadership import Election, NotLeader, job_prefix
from .state import STATE_FILENAME, JobState, Stage, StateFileError, save_state

__all__ = [
    "COORDINATOR_ENV",
    "Candidacy",
    "EtcdError",
    "EtcdStateStore",
    "Handoff",
    "NotLeader",
    "connect_etcd",
    "run",
    "state_store_for",
]

log = logging.getLogger(__name__)

#: the elected launcher's hand-off to its coordinator process (JSON): the
#: listening socket's descriptor, the leadership's identity, etcd's endpoints
COORDINATOR_ENV = "INPROCESS_ETCD_COORDINATOR"
#: seconds a leadership lives without renewal: how long a frozen leader holds
#: the job's decisions (renewed every third of it)
LEASE_TTL = 3
#: seconds an etcd request may take, failing over between its members
ETCD_TIMEOUT = 2.0
#: seconds between two looks at etcd while another candidate leads
CAMPAIGN_POLL = 0.5
#: seconds a coordinator whose term ended waits for its launcher to lead again
FOLLOW_WAIT = 3 * LEASE_TTL
#: seconds the coordinator process gets to end after its job ended
COORDINATOR_GRACE = 30.0


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What the elected launcher hands its coordinator process."""

    listen_fd: int
    identity: str
    endpoint: str
    etcd: tuple[str, ...]
    job: str

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Handoff | None:
        """The hand-off this process was started with; None in a launcher.

        Raises:
            ValueError: the variable is set but malformed.
        """
        text = (os.environ if env is None else env).get(COORDINATOR_ENV)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                listen_fd=int(data["listen_fd"]),
                identity=str(data["identity"]),
                endpoint=str(data["endpoint"]),
                etcd=tuple(str(e) for e in data["etcd"]),
                job=str(data["job"]),
            )
        except (ValueError, TypeError, KeyError) as ex:
            raise ValueError(f"{COORDINATOR_ENV} is malformed: {ex}") from None


def connect_etcd(endpoints: tuple[str, ...] | list[str]) -> Etcd:
    """A client of the job's etcd, checked to answer.

    Raises:
        EtcdUnavailable: no member answered (the message names every endpoint).
    """
    etcd = Etcd(list(endpoints), timeout=ETCD_TIMEOUT)
    try:
        etcd.check()
    except EtcdError:
        etcd.close()
        raise
    return etcd


def following_election(handoff: Handoff) -> Election:
    """The coordinator's view of its launcher's leadership (guarded writes only).

    Raises:
        NotLeader: the launcher does not lead (within :data:`FOLLOW_WAIT`).
    """
    etcd = connect_etcd(handoff.etcd)
    election = Election(
        etcd, handoff.job, handoff.identity, handoff.endpoint, os.environ[JOB_SECRET_ENV], LEASE_TTL
    )
    election.follow(FOLLOW_WAIT)
    return election


class CoordinatorStateStore(EtcdStateStore):
    """The job's state in etcd as its coordinator writes it.

    etcd holds the authority: every save is a guarded write of the launcher's
    term. A save that finds the term over waits for the launcher to lead again
    (its lease expired while its machine was frozen, and it won again since)
    and is made under the new term; where another identity leads,
    :class:`NotLeader` ends this coordinator (a decision is never taken twice).

    Each state written to etcd is then mirrored to ``<state_dir>/state.json``
    for what reads the job's state on this machine (the status line, the
    supervisor, ``inprocess-run report``); a coordinator never loads it.
    """

    def __init__(self, election: Election, state_dir: str | os.PathLike[str]) -> None:
        super().__init__(election)
        self.mirror = os.path.join(os.fspath(state_dir), STATE_FILENAME)

    def load(self) -> JobState:
        state = super().load()
        self._mirror(state)
        return state

    def create(self, state: JobState) -> None:
        super().create(state)
        self._mirror(state)

    def save(self, state: JobState) -> None:
        try:
            super().save(state)
        except NotLeader as ex:
            log.warning(
                "the job's state is not saved (%s): waiting up to %ds for this machine to "
                "lead the job again",
                ex,
                FOLLOW_WAIT,
            )
            leader = self.election.follow(FOLLOW_WAIT)
            log.warning("this machine leads the job again (term %d): saving", leader.term)
            super().save(state)
        self._mirror(state)

    def _mirror(self, state: JobState) -> None:
        save_state(self.mirror, state)


def state_store_for(handoff: Handoff, state_dir: str | os.PathLike[str]) -> EtcdStateStore:
    """The job's state in etcd, written under the launcher's leadership (and
    mirrored into ``state_dir``)."""
    return CoordinatorStateStore(following_election(handoff), state_dir)


def state_exists(etcd: Etcd, job: str) -> bool:
    """Whether the job's state is in etcd (the job has started)."""
    return etcd.get(job_prefix(job) + "state") is not None


def job_ended(election: Election) -> bool:
    """Whether the job's state in etcd says it stopped (read with ``election``'s
    client; a state that cannot be read does not say so)."""
    key = election.prefix + "state"
    try:
        kv = election.etcd.get(key)
    except EtcdError:
        return False
    text = open_first(key, kv.value if kv is not None else None, election.secret)
    if text is None:
        return False
    try:
        return json.loads(text).get("stage") == Stage.STOPPED.value
    except (ValueError, AttributeError):
        return False


def job_started(handoff: Handoff) -> bool:
    """Whether the coordinator of ``handoff`` takes over a job that runs (its
    state is in etcd) rather than starting it."""
    with contextlib.closing(connect_etcd(handoff.etcd)) as etcd:
        return state_exists(etcd, handoff.job)


def save_nodes(store: EtcdStateStore, config: NodesConfig) -> None:
    """Keeps who joined the job on which slot in etcd (sealed, guarded): what a
    coordinator elected later needs to take the machines over."""
    key = store.election.prefix + "nodes"
    store.election.guarded_put(key, seal(key, config.to_json(), store.election.secret))


def load_nodes(store: EtcdStateStore, state_dir: str | os.PathLike[str]) -> NodesConfig:
    """Who joined the job on which slot, from etcd (saved into ``state_dir`` too).

    Raises:
        StateFileError: nothing authentic is kept there.
    """
    key = store.election.prefix + "nodes"
    kv = store.election.etcd.get(key)
    text = open_first(key, kv.value if kv is not None else None, store.election.secret)
    if text is None:
        raise StateFileError(f"etcd:{key}: no record of the job's machines sealed with its secret")
    config = NodesConfig.from_json(text)
    config.save(Path(state_dir))
    return config


class Candidacy:
    """This launcher's campaign for the job's coordinator, and the coordinator
    process it runs while it leads (a thread).

    Invariants: at most one coordinator process of this launcher lives at a
    time (started and ended by this thread only); a coordinator process is
    started only while this launcher's election has won (its guarded writes
    fail anyway once the term is over), and is ended as soon as another
    launcher is seen leading; once this launcher's coordinator ended by itself
    (the job is over), it campaigns no more.
    """

    def __init__(
        self,
        etcd: Etcd,
        job: str,
        identity: str,
        listener: socket.socket,
        argv: list[str],
        host: str,
    ) -> None:
        endpoint = f"{host}:{listener.getsockname()[1]}"
        self.election = Election(
            etcd, job, identity, endpoint, os.environ[JOB_SECRET_ENV], LEASE_TTL, self.lost
        )
        self.listener = listener
        self.argv = argv
        self.process: subprocess.Popen[bytes] | None = None
        #: this launcher's coordinator ended by itself: the job is over
        self.job_over = False
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inprocess-candidacy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def lost(self) -> None:
        """The election's ``on_lost``: campaign again."""
        self._lost.set()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.job_over:
            try:
                self.election.campaign(timeout=CAMPAIGN_POLL, stop=self._stop)
            except TimeoutError:
                self._stand_down_if_another_leads()
                continue
            except EtcdError as ex:
                log.debug("campaign: %s", ex)
                self._stop.wait(CAMPAIGN_POLL)
                continue
            self._lost.clear()
            if self.process is None and job_ended(self.election):
                # (its coordinator resigned as the job ended: nothing to take over)
                self.job_over = True
                self.election.resign()
                return
            if self.process is None:
                self.process = self._start_coordinator()
            else:
                log.warning(
                    "job %s: leading again (term %s): the coordinator goes on",
                    self.election.job,
                    self.election.term,
                )
            while not self._stop.is_set() and not self._lost.is_set():
                if self.process.poll() is not None:  # it ended with the job
                    self.job_over = True
                    self.election.resign()
                    return
                self._stop.wait(0.2)

    def _stand_down_if_another_leads(self) -> None:
        """Ends this launcher's coordinator once another launcher leads: its term
        is over, its writes fail already, and the agents go to the new one."""
        if self.process is None:
            return
        try:
            leader = self.election.leader()
        except EtcdError:
            return
        if leader is None or leader.identity == self.election.identity:
            return
        log.warning(
            "job %s: %s leads it now (term %d): this machine's coordinator stands down",
            self.election.job,
            leader.identity,
            leader.term,
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def _start_coordinator(self) -> subprocess.Popen[bytes]:
        handoff = Handoff(
            listen_fd=self.listener.fileno(),
            identity=self.election.identity,
            endpoint=self.election.endpoint,
            etcd=tuple(self.election.etcd.endpoints),
            job=self.election.job,
        )
        env = {**os.environ, COORDINATOR_ENV: handoff.to_env()}
        log.info(
            "job %s: elected coordinator (term %s), listening at %s",
            self.election.job,
            self.election.term,
            self.election.endpoint,
        )
        return subprocess.Popen(
            [sys.executable, "-m", "inprocess.failover.cli", *self.argv],
            env=env,
            pass_fds=(self.listener.fileno(),),
            start_new_session=True,  # (a Ctrl-C reaches it through this launcher)
        )

    def stop(self, grace: float = COORDINATOR_GRACE) -> int | None:
        """Stops campaigning; waits up to ``grace`` for the coordinator process to
        end (it ends with the job), then kills its process group. Its exit code."""
        self._stop.set()
        self._thread.join()
        process = self.process
        if process is None:
            return None
        try:
            return process.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("the job's coordinator did not end within %.0fs: killed", grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return process.wait()

    def signal(self, signum: int) -> None:
        """Passes a stop signal on to the coordinator process, if it runs."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)


def run(args: argparse.Namespace, mn: MultiNodeArgs, argv: list[str]) -> int:
    """This machine's launcher of an etcd-coordinated job, until the job ends;
    its exit code."""
    from .multinode import StartError, agreed_args, hello, listen, machine_name
    from .node_agent import CoordinatorUnreachable, NodeAgent
    from .supervisor import RUN_TOKEN_ENV

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s inprocess-run[agent] %(levelname)s %(message)s"
    )
    assert mn.job_id is not None  # (cluster_env requires one with etcd)
    os.environ[RUN_TOKEN_ENV] = secrets.token_hex(16)
    name = mn.node_name or machine_name()
    try:
        etcd = connect_etcd(mn.etcd_endpoints)
    except EtcdUnavailable as ex:
        log.error("cannot start: %s", ex)
        return 1
    try:
        listener = listen(mn.coordinator_host, mn.coordinator_port)
    except StartError as ex:
        etcd.close()
        log.error("%s", ex)
        return 1
    identity = f"{name}/{os.getpid()}/{secrets.token_hex(4)}"
    candidacy = Candidacy(etcd, mn.job_id, identity, listener, argv, mn.coordinator_host)
    election = candidacy.election
    candidacy.start()

    def locate() -> tuple[str, int] | None:
        leader = election.leader()
        if leader is None:
            return None
        host, _, port = leader.endpoint.rpartition(":")
        return host, int(port)

    agent = NodeAgent(
        (mn.coordinator_host, 0),
        os.environ[JOB_SECRET_ENV],
        hello(mn.job_id, mn.node_rank, agreed_args(args, mn), name),
        connect_timeout=args.rdzv_timeout,
        locate=locate,
        # a stop signal stops the job through this machine's coordinator, if it
        # leads, before this machine's workers stop (not taken for their loss)
        on_signal=candidacy.signal,
    )
    try:
        code = agent.run()
    except CoordinatorUnreachable as ex:
        log.error("%s", ex)
        code = 1
    finally:
        coordinator_code = candidacy.stop()
        election.close()
        listener.close()
        etcd.close()
    if coordinator_code not in (None, 0) and code == 0:
        code = coordinator_code
    return code
