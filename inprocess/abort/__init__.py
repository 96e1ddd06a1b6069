"""Abort: stop whatever the wrapped function is blocked in, from another thread.

``Abort`` instances run in the monitor thread while the main thread may still
be blocked (in a collective, typically), and again in the main thread on the
restart path; they must therefore be idempotent and thread-safe.

Modules, one step of releasing a blocked rank each:

* :mod:`.base`: :class:`Abort`, the base class of the Wrapper's ``abort`` argument;
* :mod:`.torch_distributed`: :class:`AbortTorchDistributed`, the default, which
  runs the releases below in order, then destroys the process groups;
* :mod:`.gloo`: breaks the pair connections of the gloo groups;
* :mod:`.rendezvous`: the per-iteration ``env://`` rendezvous, and the release
  of the connections (and holding of the store servers) the function opened in
  the current iteration;
* :mod:`.sockets`: this process's TCP sockets and an fd-reuse safe shutdown.

How the rendezvous release and the Wrapper meet: the Wrapper enters
:func:`.rendezvous.fresh_env_rendezvous` around every call of the function;
while it is entered, the module records the sockets the process had when the
call began (its ``_baseline``), and only then do
:func:`.rendezvous.release_iteration_connections` and
:func:`.rendezvous.hold_iteration_servers` act (outside it they do nothing).
That per-process state is the only link between the Wrapper's loop and
:class:`AbortTorchDistributed`; it lives in :mod:`.rendezvous` alone, and
:mod:`.torch_distributed` imports the two functions by name.
"""

from .base import Abort
from .torch_distributed import AbortTorchDistributed

__all__ = ["Abort", "AbortTorchDistributed"]
