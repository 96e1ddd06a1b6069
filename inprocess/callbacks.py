"""The Wrapper's callbacks as a call runs them, and what their failure means for the rank.

Each callback is called in the shape of its generation (:mod:`inprocess.generation`).
A callback's return value is used only when it is a State (or a tuple starting
with one); anything else, ``None`` included, keeps the current state: every
method of :class:`Callbacks` returns the State the call goes on with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import device_fault
from . import generation as _gen
from .exception import HealthCheckError
from .state import State

if TYPE_CHECKING:
    from .config import WrapperConfig

log = logging.getLogger(__name__)


def returned_state(result: Any, current: State) -> State:
    """The state a callback returned: a State, or the first item of a tuple; else ``current``."""
    if isinstance(result, State):
        return result
    if isinstance(result, tuple) and result and isinstance(result[0], State):
        return result[0]
    return current


def _broken_context(fault: BaseException | None) -> str | None:
    """CUDA's words when ``fault`` (the exception that ended the function) is a
    CUDA error and this process's CUDA context no longer works; else ``None``."""
    if device_fault.cause_of(fault) is None:
        return None
    from .health_check.restart import ChainedGPUHealthCheck

    try:
        ChainedGPUHealthCheck.check_context(fault)
    except Exception as broken:
        return device_fault.cause_of(broken) or device_fault.cause_of(fault)
    return None


class Callbacks:
    """Runs a Wrapper's callbacks for one rank of a call.

    Args:
        config: the Wrapper's settings (its callbacks and their generation).
        identity: this rank's identity in the call (named in logs and errors).
        restart_check: the check after a fault (``Wrapper.restart_health_check``,
            else the user's ``health_check``); ``None``: no check.
        leave: records that this rank leaves the job, with the reason; called
            before a callback's failure is raised.
    """

    def __init__(
        self,
        config: WrapperConfig,
        identity: str,
        restart_check: Any,
        leave: Callable[[str], None],
    ) -> None:
        self.config, self.identity = config, identity
        self.restart_check, self.leave = restart_check, leave

    def invoke(self, name: str, state: State, *exception: BaseException | None) -> Any:
        """Calls the callback ``name`` in the shape of its generation (``exception``: the
        usage guide's second argument, the newer generation's ``fn_exception``)."""
        callback = getattr(self.config, name)
        return _gen.invoke(callback, self.config.generation, state, *exception)

    def initialize(self, state: State) -> State:
        if self.config.initialize is None:
            return state
        return returned_state(self.invoke("initialize", state), state)

    def health_check(self, state: State) -> State:
        """The user's check at the start of an iteration: failing, it is a fault of the
        iteration (raised), not the end of the rank."""
        if self.config.health_check is None:
            return state
        return returned_state(self.invoke("health_check", state, None), state)

    def abort(self, state: State) -> State:
        if self.config.abort is None:
            return state
        try:
            return returned_state(self.invoke("abort", state), state)
        except Exception:
            self.leave("abort failed")
            raise

    def finalize(self, state: State, ex: BaseException | None) -> State:
        if self.config.finalize is None:
            return state
        try:
            return returned_state(self.invoke("finalize", state, ex), state)
        except BaseException as failure:
            self.leave(f"finalize failed: {failure!r}")
            raise

    def restart_health_check(self, state: State, ex: BaseException | None) -> State:
        """The check after a fault: failing it ends this rank with a ``HealthCheckError``
        whose ``__cause__`` is ``ex``, the exception that ended the function here.
        With ``LOCAL_RANK`` set, the device checks run first (NIC, NVLink, GPU),
        then the user's (``Wrapper.restart_health_check``)."""
        check = self.restart_check
        if check is None:
            return state
        try:
            result = _gen.invoke(check, self.config.generation, state, ex)
            return returned_state(result, state)
        except Exception as failure:
            # Invariant: a rank that leaves after a CUDA error knows whether its
            # CUDA context is broken before its cleanup runs, whichever check failed
            # (the NIC and NVLink checks run before the GPU check, which asks it).
            gpu = device_fault.cause_of(failure) or _broken_context(ex)
            if gpu is not None:
                # this process's CUDA context is gone: it must end without freeing CUDA memory
                device_fault.mark_broken(gpu)
            reason = f"GPU fault ({gpu}): " if gpu is not None else ""
            self.leave(f"health check failed: {reason}{failure!r}")
            if isinstance(failure, HealthCheckError) and failure.__cause__ in (None, ex):
                raise failure from ex
            raise HealthCheckError(
                f"{self.identity}: unhealthy after a fault: {type(failure).__name__}: {failure}"
            ) from ex
        except BaseException as failure:
            self.leave(f"health check failed: {failure!r}")
            raise

    def completion(self, state: State) -> None:
        """The newer generation's ``completion``: its failure is logged, not raised."""
        if self.config.completion is None:
            return
        try:
            self.config.completion(_gen.frozen(state))
        except Exception as ex:
            log.error("%s: completion failed: %r", self.identity, ex)

    def terminate(self, state: State, ex: BaseException) -> None:
        """The newer generation's ``terminate``, as this rank's call ends with ``ex``."""
        if self.config.terminate is None:
            return
        try:
            self.config.terminate(_gen.frozen(state, ex))
        except Exception as failure:
            log.error("%s: terminate failed: %r", self.identity, failure)
            raise failure from ex
