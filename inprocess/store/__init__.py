"""The distributed store protocol of the Wrapper: its mechanics.

Every rank (and every rank's monitor process) talks to one key-value store. This
package implements the protocol on top of any ``torch.distributed.Store``; its
key schema, its decisions and what a job controller reads of it are in
:mod:`inprocess.protocol`:

Identities
    A rank is identified by ``"<initial rank>/<token>"`` where the token is
    unique to the process. A relaunched process that rejoins a job therefore has
    a new identity, and a terminated identity can never reappear.

Records
    Every value is a sealed record (MAC'd under the job's secret and the key's
    full name, see :mod:`inprocess.security`); readers act on authentic
    records only. Counters carry no MAC, so they only wake readers.

Faults
    ``fault_log`` is an append-only list with one entry per fault; anything
    that requires a restart (an exception, a timeout, a dead rank, a rank
    asking to join) appends one. The fault count is the number of authentic
    entries. An iteration records the count when it was decided (its
    *baseline*); the iteration is faulted once the count exceeds it. Each
    entry is followed by an increment of the ``faults`` counter, which monitor
    threads poll with a single ``add(key, 0)`` per interval; they read the log
    only when it changes.

Outcome
    ``i<k>/o`` (the outcome) is a once-key: ``"completed"`` from the last rank
    arriving at the completion barrier, ``"fault"`` from whoever first acts on a
    fault. The first authentic record decides the iteration for everybody; a
    fault recorded after completion is ignored.

Terminated ranks
    ``terminated`` is an append-only list of identities. Marking a rank terminated
    appends its reason to the fault log (its fault), then appends it to the
    list, then increments the counters; deciders read the fault log *before*
    ``terminated``. So a death is either part of a decision's terminated set or
    raises the count above that decision's baseline, never neither; a listed
    death always has its reason in the fault log (every rank logs the restart's
    root cause); and a decider reads again until the log it read has each death
    it lists, so a death is not *both* either (which would restart the
    iteration it decided for nothing).

Rendezvous
    A rendezvous completes when every participant has either arrived or been
    terminated (authentic arrival records and deaths; the arrival counter only
    says when to look). Whoever notices completion (the last arrival, or a
    waiter that saw a termination) computes the decision and publishes it to a
    once-key, so all ranks read the same decision. A member that died without
    arriving is counted on its behalf by the first rank that sees it listed,
    so completion needs no one to read everyone's arrivals but the one that
    completes it. Waiters block on the store until the call's next wake-up (a
    decision published, a death listed: :meth:`StoreMixin.wake_waiters`), no
    polling, in chunks of :data:`WAIT_CHUNK` growing to :data:`WAIT_CHUNK_MAX`.

Layout
    :mod:`.helpers` (identities, the job's key space, barrier errors, key names),
    :mod:`.records` (sealed records, once-keys), :mod:`.wakeups` (wake-ups, waits),
    :mod:`.ledger` (calls, faults, deaths, joins, heartbeats, membership,
    outcomes), :mod:`.rendezvous` (rendezvous, counted barriers, the relay path),
    :mod:`.exchange` (states and keys), :mod:`.stores` (:class:`StoreMixin`
    combined from those, the store classes, their hosting). Import from
    :mod:`inprocess.store` itself: every name is there.
"""

from __future__ import annotations

from ..protocol import incarnation_of as incarnation_of
from ..protocol import initial_rank_of as initial_rank_of
from ..waiting import WAIT_CHUNK as WAIT_CHUNK
from ..waiting import WAIT_CHUNK_MAX as WAIT_CHUNK_MAX
from ..waiting import WakeWait as WakeWait
from .exchange import _STATE_FIELDS as _STATE_FIELDS
from .helpers import AGENT_STORE_ENV as AGENT_STORE_ENV
from .helpers import INCARNATION_ENV as INCARNATION_ENV
from .helpers import NAMESPACE_ENV as NAMESPACE_ENV
from .helpers import BarrierOverflow as BarrierOverflow
from .helpers import BarrierRefused as BarrierRefused
from .helpers import BarrierTimeout as BarrierTimeout
from .helpers import Poller as Poller
from .helpers import _served_name as _served_name
from .helpers import incarnation_from_env as incarnation_from_env
from .helpers import job_namespace as job_namespace
from .helpers import key_path as key_path
from .helpers import new_identity as new_identity
from .helpers import waits_in_server as waits_in_server
from .records import _ABSENT as _ABSENT
from .rendezvous import _REFUSED as _REFUSED
from .rendezvous import COUNTED_WAIT as COUNTED_WAIT
from .rendezvous import RELAYED_LOOK as RELAYED_LOOK
from .rendezvous import _Reads as _Reads
from .stores import ClientSpec as ClientSpec
from .stores import FileStore as FileStore
from .stores import PrefixStore as PrefixStore
from .stores import StoreMixin as StoreMixin
from .stores import TCPStore as TCPStore
from .stores import _bound_listener as _bound_listener
from .stores import _env as _env
from .stores import _listening_here as _listening_here
from .stores import _prefixed as _prefixed
from .stores import describe as describe
from .stores import externally_hosted as externally_hosted
