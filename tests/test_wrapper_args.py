"""Construction-time validation of the Wrapper, and the shape of its public API."""

from __future__ import annotations

import datetime
import typing
from typing import Optional, Union

import pytest

import inprocess
from inprocess.wrap import call_wrapper_parameters

td = datetime.timedelta


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"store_factory": dict}, TypeError, "store_factory"),
        ({"store_factory": lambda: None}, TypeError, "store_factory"),
        ({"store_kwargs": [1]}, TypeError, "store_kwargs"),
        ({"store_kwargs": {1: "x"}}, TypeError, "store_kwargs"),
        ({"initialize": lambda s: s}, TypeError, "initialize"),
        ({"abort": object()}, TypeError, "abort"),
        ({"finalize": 1}, TypeError, "finalize"),
        ({"health_check": "x"}, TypeError, "health_check"),
        ({"rank_assignment": None}, TypeError, "rank_assignment"),
        ({"rank_filter": 3}, TypeError, "rank_filter"),
        ({"soft_timeout": 60}, TypeError, "soft_timeout"),
        ({"monitor_thread_interval": 1.0}, TypeError, "monitor_thread_interval"),
        ({"monitor_process_interval": td(seconds=0)}, ValueError, "monitor_process_interval"),
        ({"progress_watchdog_interval": td(seconds=-1)}, ValueError, "progress_watchdog_interval"),
        ({"last_call_wait": td(seconds=-1)}, ValueError, "last_call_wait"),
        ({"termination_grace_time": td(seconds=-1)}, ValueError, "termination_grace_time"),
        ({"soft_timeout": td(seconds=90)}, ValueError, "soft_timeout"),
        ({"hard_timeout": td(seconds=200)}, ValueError, "hard_timeout"),
        ({"heartbeat_timeout": td(seconds=130)}, ValueError, "heartbeat_timeout"),
        ({"monitor_process_interval": td(seconds=31)}, ValueError, "monitor_process_interval"),
        ({"heartbeat_interval": td(seconds=31)}, ValueError, "heartbeat_interval"),
        ({"monitor_thread_interval": td(seconds=61)}, ValueError, "monitor_thread_interval"),
        ({"progress_watchdog_interval": td(seconds=61)}, ValueError, "progress_watchdog_interval"),
        ({"monitor_process_logfile": "relative/log.txt"}, ValueError, "monitor_process_logfile"),
        ({"monitor_process_logfile": "/tmp/{node}.log"}, ValueError, "monitor_process_logfile"),
        ({"monitor_process_logfile": 5}, TypeError, "monitor_process_logfile"),
        ({"enabled": 1}, TypeError, "enabled"),
    ],
)
def test_invalid_argument_is_a_clear_error(kwargs, error, name):
    with pytest.raises(error, match=name):
        inprocess.Wrapper(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        inprocess.Wrapper(inprocess.store.TCPStore)  # type: ignore[misc]


def test_defaults_and_heartbeat_interval():
    w = inprocess.Wrapper()
    assert w.soft_timeout == td(seconds=60)
    assert w.hard_timeout == td(seconds=90)
    assert w.heartbeat_timeout == td(seconds=30)
    assert w.barrier_timeout == td(seconds=120)
    assert w.completion_timeout == td(seconds=120)
    assert w.last_call_wait == td(seconds=1)
    assert w.termination_grace_time == td(seconds=5)
    assert isinstance(w.abort, inprocess.abort.AbortTorchDistributed)
    assert isinstance(w.rank_assignment, inprocess.rank_assignment.ShiftRanks)
    assert w.heartbeat_interval == w.heartbeat_timeout / 4  # four beats per timeout
    assert inprocess.Wrapper(heartbeat_timeout=td(seconds=2)).heartbeat_interval == td(seconds=1)
    w2 = inprocess.Wrapper(heartbeat_interval=td(seconds=2))
    assert w2.heartbeat_interval == td(seconds=2)
    # each Wrapper gets its own default abort
    assert w.abort is not w2.abort


def test_logfile_with_rank_placeholder_is_accepted():
    inprocess.Wrapper(monitor_process_logfile="/tmp/monitor_{rank}.log")


def test_disabled_wrapper_returns_the_function_untouched():
    def train():
        return 1

    assert inprocess.Wrapper(enabled=False)(train) is train


def test_calling_with_distributed_initialized_is_a_value_error(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:

        @inprocess.Wrapper()
        def train():
            return 1

        with pytest.raises(ValueError, match="already initialized") as info:
            train()
        assert "requires `not torch.distributed.is_initialized()`" in str(info.value)
    finally:
        dist.destroy_process_group()
        del store


# ------------------------------------------------------------------ CallWrapper injection

CW = inprocess.CallWrapper


def f_plain(a, cw: inprocess.CallWrapper): ...
def f_optional(a, cw: Optional[inprocess.CallWrapper] = None): ...  # noqa: UP045
def f_union(a, cw: Union[inprocess.CallWrapper, None] = None): ...  # noqa: UP007
def f_pipe(a, cw: inprocess.CallWrapper | None = None): ...
def f_alias(a, cw: CW): ...
def f_none(a, cw=None): ...
def f_other(a, cw: int = 0): ...
def f_two(x: CW, y: typing.Optional[CW] = None): ...  # noqa: UP045


def f_str1(a, cw: CallWrapper): ...  # noqa: F821
def f_str2(a, cw: inprocess.CallWrapper | None = None): ...
def f_str3(a, cw: inprocess.CallWrapper | None = None): ...
def f_str4(a, cw: CallWrapper | None = None): ...  # noqa: F821
def f_str5(a, cw: CallWrapper | None = None): ...  # noqa: F821


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (f_plain, ["cw"]),
        (f_optional, ["cw"]),
        (f_union, ["cw"]),
        (f_pipe, ["cw"]),
        (f_alias, ["cw"]),
        (f_none, []),
        (f_other, []),
        (f_two, ["x", "y"]),
        (f_str1, ["cw"]),
        (f_str2, ["cw"]),
        (f_str3, ["cw"]),
        (f_str4, ["cw"]),
        (f_str5, ["cw"]),
    ],
)
def test_call_wrapper_injection_by_annotation(fn, expected):
    assert call_wrapper_parameters(fn) == expected


def test_postponed_annotations_module():
    namespace: dict = {}
    exec(
        "from __future__ import annotations\n"
        "import inprocess\n"
        "def train(model, call_wrapper: inprocess.CallWrapper | None = None): ...\n",
        namespace,
    )
    assert call_wrapper_parameters(namespace["train"]) == ["call_wrapper"]


# ------------------------------------------------------------------ Compose


def test_compose_runs_last_first_and_keeps_the_base_class():
    calls = []

    class Step(inprocess.initialize.Initialize):
        def __init__(self, name):
            self.name = name

        def __call__(self, state):
            calls.append(self.name)
            return state

    composed = inprocess.Compose(Step("a"), Step("b"), Step("c"))
    assert isinstance(composed, inprocess.initialize.Initialize)
    state = inprocess.state.State(rank=0, world_size=1)
    assert composed(state) is state
    assert calls == ["c", "b", "a"]
    inprocess.Wrapper(initialize=composed)  # accepted where an Initialize is expected


def test_compose_unpacks_tuples():
    class Fin(inprocess.finalize.Finalize):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, state, train_ex=None):
            state.iteration += self.tag
            return state, train_ex

    composed = inprocess.Compose(Fin(1), Fin(10))
    assert isinstance(composed, inprocess.finalize.Finalize)
    state, ex = composed(inprocess.state.State(rank=0, world_size=1), None)
    assert state.iteration == 11 and ex is None


def test_compose_calls_callables_without_arguments_with_none():
    calls = []

    def first():
        calls.append("first")

    def second():
        calls.append("second")
        return "done"

    assert inprocess.Compose(second, first)() == "done"
    assert calls == ["first", "second"]
    # a callable taking no arguments in a chain that has some is called with none
    calls.clear()
    assert inprocess.Compose(lambda x: x + 1, first)(1) == 2
    assert calls == ["first"]


def test_compose_passes_results_on_as_arguments():
    # a tuple becomes the next callable's arguments, a single value its one argument
    assert inprocess.Compose(lambda a, b: a * b, lambda x: (x, x + 1))(3) == 12
    assert inprocess.Compose(lambda x: [x], lambda a, b: a + b)(1, 2) == [3]


def test_compose_warns_when_a_callable_given_arguments_returns_none():
    seen = []

    def forgets_to_return(x):
        seen.append(("forgets", x))

    def uses(x):
        seen.append(("uses", x))
        return x

    with pytest.warns(UserWarning, match="returned None"):
        assert inprocess.Compose(uses, forgets_to_return)(5) == 5
    assert seen == [("forgets", 5), ("uses", 5)]  # the next one got the same arguments
    # a guide-era Finalize returning None composes too
    ran = []

    class Fin(inprocess.finalize.Finalize):
        def __call__(self, state, train_ex=None):
            ran.append(train_ex)

    ex = ValueError()
    with pytest.warns(UserWarning, match="returned None"):
        inprocess.Compose(Fin(), Fin())(inprocess.state.State(rank=0, world_size=1), ex)
    assert ran == [ex, ex]


def test_compose_no_warning_without_arguments_or_a_value_expected():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert inprocess.Compose(lambda: None, lambda: None)() is None
        assert inprocess.Compose(lambda x: None)(1) is None  # last one: the caller decides


def test_compose_errors():
    with pytest.raises(ValueError):
        inprocess.Compose()
    with pytest.raises(TypeError, match="not callable"):
        inprocess.Compose(1)


def test_state_defaults_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    s = inprocess.state.State()
    assert (s.rank, s.world_size, s.initial_rank, s.initial_world_size) == (3, 8, 3, 8)
    assert s.active_world_size == 8 and s.iteration == 0
    s.active_world_size = 2
    s.apply_active_world_size()
    assert s.mode == inprocess.state.Mode.INACTIVE
    with pytest.raises(ValueError):
        inprocess.state.State(rank=5, world_size=2)


def test_state_copy_does_not_copy_the_exception():
    class Unpicklable(Exception):
        def __deepcopy__(self, memo):
            raise AssertionError("deep-copied")

    ex = Unpicklable()
    s = inprocess.state.State(rank=0, world_size=1, fn_exception=ex)
    assert s.copy().fn_exception is ex


def test_public_names():
    assert inprocess.exception.RestartAbort.__mro__[1] is BaseException
    assert issubclass(inprocess.monitor_thread.RankShouldRestart, BaseException)
    assert not issubclass(inprocess.monitor_thread.RankShouldRestart, Exception)
    for name in ("RestartError", "HealthCheckError", "InternalError", "TimeoutError"):
        assert issubclass(getattr(inprocess.exception, name), Exception)
    assert issubclass(inprocess.rank_assignment.RankDiscarded, inprocess.exception.RestartError)
    for name in ("StoreMixin", "TCPStore", "PrefixStore", "FileStore"):
        assert hasattr(inprocess.store, name)
    from inprocess.tools.inject_fault import Fault, inject_fault

    assert callable(inject_fault)
    # the seed's members (the newest generation adds WORKLOAD_EXC and aliases)
    assert {f.name for f in Fault} - {"WORKLOAD_EXC"} == {
        "GPU",
        "GPU_SLEEP",
        "ASYNC_EXC",
        "SIGNAL_EXC",
        "ABORT",
        "GIL",
        "SEGFAULT",
        "INT",
        "KILL",
        "TERM",
        "STOP",
    }
