"""Initialize (RetryController) and Finalize (ThreadedFinalize)."""

from __future__ import annotations

import datetime
import threading

import pytest

from inprocess.compose import Compose
from inprocess.exception import RestartAbort
from inprocess.exception import TimeoutError as RestartTimeoutError
from inprocess.finalize import Finalize, ThreadedFinalize
from inprocess.initialize import Initialize, RetryController
from inprocess.state import State

pytestmark = pytest.mark.timeout(30)


def make_state(iteration: int = 0, world_size: int = 8, active: int | None = None) -> State:
    state = State(rank=0, world_size=world_size, iteration=iteration)
    if active is not None:
        state.active_world_size = active
    return state


# ---------------------------------------------------------------------- RetryController


def test_retry_controller_max_iterations():
    controller = RetryController(max_iterations=3)
    for iteration in range(3):  # iterations 0, 1, 2 run: the function runs 3 times
        state = make_state(iteration)
        assert controller(state) is state
    with pytest.raises(RestartAbort, match=r"iteration=3 .*max_iterations=3"):
        controller(make_state(3))
    with pytest.raises(RestartAbort):
        controller(make_state(10))


def test_retry_controller_single_iteration_means_no_restart():
    controller = RetryController(max_iterations=1)
    controller(make_state(0))
    with pytest.raises(RestartAbort):
        controller(make_state(1))


def test_retry_controller_unlimited_by_default():
    controller = RetryController()
    for iteration in (0, 1, 100, 10**6):
        controller(make_state(iteration, world_size=1, active=1))


def test_retry_controller_min_world_size():
    controller = RetryController(min_world_size=4)
    controller(make_state(world_size=4))
    with pytest.raises(RestartAbort, match="min_world_size=4"):
        controller(make_state(world_size=3))


def test_retry_controller_min_active_world_size():
    controller = RetryController(min_active_world_size=2)
    controller(make_state(world_size=8, active=2))
    with pytest.raises(RestartAbort, match="min_active_world_size=2"):
        controller(make_state(world_size=8, active=1))


def test_retry_controller_abort_is_a_base_exception():
    # A BaseException passes through `except Exception` in user code and ends the Wrapper.
    assert not issubclass(RestartAbort, Exception)
    assert issubclass(RestartAbort, BaseException)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"max_iterations": 0}, ValueError, "max_iterations"),
        ({"max_iterations": -1}, ValueError, "max_iterations"),
        ({"max_iterations": 2.5}, TypeError, "max_iterations"),
        ({"max_iterations": True}, TypeError, "max_iterations"),
        ({"min_world_size": 0}, ValueError, "min_world_size"),
        ({"min_world_size": "2"}, TypeError, "min_world_size"),
        ({"min_active_world_size": 0}, ValueError, "min_active_world_size"),
        ({"min_active_world_size": None}, TypeError, "min_active_world_size"),
    ],
)
def test_retry_controller_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        RetryController(**kwargs)


def test_initializers_compose():
    calls: list[str] = []

    class Record(Initialize):
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, state: State) -> State:
            calls.append(self.name)
            return state

    chain = Compose(Record("second"), RetryController(max_iterations=2), Record("first"))
    assert isinstance(chain, Initialize)
    state = make_state(1)
    assert chain(state) is state
    assert calls == ["first", "second"]
    calls.clear()
    with pytest.raises(RestartAbort):
        chain(make_state(2))
    assert calls == ["first"]


# ---------------------------------------------------------------------- ThreadedFinalize


SECOND = datetime.timedelta(seconds=1)


def test_threaded_finalize_runs_fn_with_arguments():
    seen: list[object] = []
    finalize = ThreadedFinalize(
        timeout=SECOND, fn=lambda a, b=None: seen.append((a, b)), args=(1,), kwargs={"b": 2}
    )
    state, ex = make_state(), ValueError("from the function")
    assert finalize(state, ex) == (state, ex)
    assert finalize(state) == (state, None)
    assert seen == [(1, 2), (1, 2)]


def test_threaded_finalize_runs_in_another_thread():
    threads: list[threading.Thread] = []
    ThreadedFinalize(SECOND, lambda: threads.append(threading.current_thread()))(make_state())
    assert threads and threads[0] is not threading.current_thread()
    assert threads[0].daemon


def test_threaded_finalize_reraises_exception():
    error = RuntimeError("cleanup failed")

    def fn() -> None:
        raise error

    with pytest.raises(RuntimeError, match="cleanup failed") as info:
        ThreadedFinalize(SECOND, fn)(make_state())
    assert info.value is error


def test_threaded_finalize_reraises_base_exception():
    with pytest.raises(KeyboardInterrupt):
        ThreadedFinalize(SECOND, _raise_keyboard_interrupt)(make_state())


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def test_threaded_finalize_timeout():
    release = threading.Event()
    try:
        finalize = ThreadedFinalize(datetime.timedelta(seconds=0.1), release.wait, args=(10,))
        with pytest.raises(RestartTimeoutError, match="did not finish"):
            finalize(make_state())
    finally:
        release.set()  # let the daemon thread end


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"timeout": 1}, TypeError, "timeout"),
        ({"timeout": datetime.timedelta(0)}, ValueError, "timeout"),
        ({"timeout": datetime.timedelta(seconds=-1)}, ValueError, "timeout"),
        ({"fn": "not callable"}, TypeError, "fn"),
        ({"args": [1]}, TypeError, "args"),
        ({"kwargs": [("a", 1)]}, TypeError, "kwargs"),
    ],
)
def test_threaded_finalize_bad_arguments(kwargs, error, name):
    arguments = {"timeout": SECOND, "fn": print, **kwargs}
    with pytest.raises(error, match=name):
        ThreadedFinalize(**arguments)


def test_finalizers_compose():
    order: list[str] = []
    chain = Compose(
        ThreadedFinalize(SECOND, order.append, args=("second",)),
        ThreadedFinalize(SECOND, order.append, args=("first",)),
    )
    assert isinstance(chain, Finalize)
    state, ex = make_state(), ValueError()
    assert chain(state, ex) == (state, ex)
    assert order == ["first", "second"]


def test_base_classes_are_abstract():
    with pytest.raises(TypeError):
        Initialize()
    with pytest.raises(TypeError):
        Finalize()
