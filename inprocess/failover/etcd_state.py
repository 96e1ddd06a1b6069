"""The controller's durable state in etcd, written only by the job's leader.

:class:`EtcdStateStore` is :class:`inprocess.failover.state.StateStore` for a
job whose launchers share an etcd cluster (``--rdzv-backend etcd``): the state
lives under ``/inprocess/<job>/state``, every save is a guarded write of the
current leadership (:meth:`inprocess.failover.leadership.Election.guarded_put`),
so a coordinator whose lease expired cannot overwrite what its successor
decided, and the value is sealed with the job's secret, so a client without
it cannot make the next coordinator load a state of its own.

The value is the state file's JSON document on one line (a sealed record is one
line) followed by its MAC; :func:`inprocess.failover.state.loads_state` reads it.
"""

from __future__ import annotations

import json
import logging

from .. import security
from .leadership import Election, KeyExistsError
from .state import (
    JobState,
    StateError,
    StateExistsError,
    StateFileError,
    loads_state,
)

__all__ = ["EtcdStateStore"]

log = logging.getLogger(__name__)


class EtcdStateStore:
    """The state of one job in etcd, with :class:`StateStore`'s interface and
    ownership rules:

    * :meth:`create` refuses when a state exists, loadable or not (naming the
      job and stage it belongs to when it can be loaded);
    * a value that cannot be loaded (not sealed with the job's secret, not a
      state) is never overwritten: nobody owns it;
    * :meth:`save` writes only after this object created or loaded the state,
      and only a state of the same job.

    Every write is conditioned on ``election``'s term: it raises
    :class:`~inprocess.failover.leadership.NotLeader` once a newer leader
    exists, and leaves the stored state as that leader wrote it.
    """

    def __init__(self, election: Election) -> None:
        if not isinstance(election, Election):
            raise TypeError(f"EtcdStateStore election must be an Election, got {election!r}")
        self.election = election
        self.key = election.prefix + "state"
        #: where the state lives, for messages
        self.path = f"etcd:{self.key}"
        self._owner: str | None = None

    def __repr__(self) -> str:
        return f"EtcdStateStore({self.path!r}, owner={self._owner!r})"

    @property
    def owner(self) -> str | None:
        """Job id this store may save for, once created or loaded; else None."""
        return self._owner

    def exists(self) -> bool:
        """Whether a value (valid or not) is stored under the key."""
        return self.election.etcd.get(self.key) is not None

    def _encode(self, state: JobState) -> bytes:
        # the state file's document, on one line (json escapes newlines in strings)
        text = json.dumps(state.to_dict(), sort_keys=True, allow_nan=False, separators=(",", ":"))
        return security.seal(self.key, text, self.election.secret).encode()

    def _decode(self, value: bytes) -> JobState:
        text = security.open_first(self.key, value, self.election.secret)
        if text is None:
            raise StateFileError(
                f"state {self.path}: not sealed with the job's secret (written by a client "
                "without it, or corrupted)"
            )
        return loads_state(text, source=self.path)

    def load(self) -> JobState:
        """Load the state and take ownership of it.

        Raises:
            FileNotFoundError: no state is stored (the same as a missing file).
            StateFileError: the value is not sealed with the job's secret, or
                not a valid state.
            EtcdError: etcd did not answer.
        """
        kv = self.election.etcd.get(self.key)
        if kv is None:
            raise FileNotFoundError(f"no state stored at {self.path}")
        state = self._decode(kv.value)
        self._owner = state.job_id
        return state

    def create(self, state: JobState) -> None:
        """Save the first state of a NEW job; refuse if a state is stored.

        Raises:
            StateExistsError: a loadable state exists (names its job and stage).
            StateFileError: a value exists and cannot be loaded.
            NotLeader: the election does not lead (any more).
        """
        try:
            self.election.guarded_put(self.key, self._encode(state), create=True)
        except KeyExistsError as ex:
            raise self._exists_error(state.job_id, ex.existing.value) from None
        self._owner = state.job_id
        log.info("created state of job %s in %s", state.job_id, self.path)

    def save(self, state: JobState) -> None:
        """Save a new state of the owned job, conditioned on the election's term.

        Raises:
            StateError: neither :meth:`create` nor :meth:`load` succeeded on this
                store, or ``state`` belongs to another job.
            NotLeader: a newer leader exists or the lease is gone; nothing was written.
        """
        if self._owner is None:
            raise StateError(
                f"refusing to write {self.path}: this EtcdStateStore neither created nor "
                "loaded it; call create() for a new job or load() to resume one"
            )
        if state.job_id != self._owner:
            raise StateError(
                f"refusing to write the state of job {state.job_id!r} to {self.path}, "
                f"which belongs to job {self._owner!r}"
            )
        self.election.guarded_put(self.key, self._encode(state))

    def _exists_error(self, new_job_id: str, value: bytes) -> StateError:
        try:
            old = self._decode(value)
        except StateFileError as ex:
            return StateFileError(
                f"cannot create job {new_job_id!r}: {self.path} already holds a value that "
                f"cannot be loaded ({ex}); it is left untouched: delete it or choose another "
                "job id"
            )
        return StateExistsError(
            f"cannot create job {new_job_id!r}: {self.path} belongs to job {old.job_id!r} "
            f"in stage {old.stage.value}; choose another job id (or resume that job)"
        )
