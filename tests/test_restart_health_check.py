"""Restart health checks of the rank's GPU, NVLink and NIC, with a fake NVML on CPU."""

from __future__ import annotations

import logging
import sys

import pytest
from test_health_check import FakeNVMLError, make_fake_pynvml

import inprocess
from inprocess.exception import HealthCheckError
from inprocess.generation import generation_of
from inprocess.health_check import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
    restart_health_checks,
)
from inprocess.state import State


def fake_nvml(monkeypatch, links=(1, 1), **kw):
    nvml = make_fake_pynvml(**kw)
    nvml.NVML_NVLINK_MAX_LINKS = 4

    def nvmlDeviceGetNvLinkState(handle, link):
        nvml.calls.append(("nvlink", handle, link))
        if link >= len(links):
            raise FakeNVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
        return links[link]

    nvml.nvmlDeviceGetNvLinkState = nvmlDeviceGetNvLinkState
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def ib(tmp_path, counts):
    for (dev, port), n in counts.items():
        d = tmp_path / dev / "ports" / str(port) / "counters"
        d.mkdir(parents=True, exist_ok=True)
        (d / "link_downed").write_text(f"{n}\n")


@pytest.fixture(autouse=True)
def fresh_nvml_probe():
    """Each test brings its own (fake or absent) NVML: forget the process's answer."""
    from inprocess.health_check import restart

    restart._nvml_absent.cache_clear()
    yield
    restart._nvml_absent.cache_clear()


@pytest.fixture
def state():
    return State(rank=0, world_size=1)


def test_gpu_failure_is_a_fault_of_the_rank(monkeypatch, state):
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake_nvml(monkeypatch, pending_pages=1)
    with pytest.raises(HealthCheckError, match="GPU 1 is unhealthy"):
        ChainedGPUHealthCheck()(state)
    fake_nvml(monkeypatch)
    assert ChainedGPUHealthCheck()(state) is state
    assert ChainedGPUHealthCheck()(state, None) == (state, None)  # the guide's shape
    frozen = state.freeze()
    assert ChainedGPUHealthCheck()(frozen) is frozen  # the newer one's


class _FakeCuda:
    """torch.cuda as a process sees it once its context is (or is not) broken."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.synchronized = 0

    def install(self, monkeypatch) -> None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def synchronize(self, device=None) -> None:
        import torch

        self.synchronized += 1
        if self.broken:
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_after_a_cuda_error_the_gpu_check_asks_the_context_too(monkeypatch, state):
    """NVML sees a healthy GPU; a sticky CUDA error broke the process's context."""
    import torch

    from inprocess.generation import frozen

    fake_nvml(monkeypatch)  # a healthy GPU
    sticky = torch.AcceleratorError("CUDA error: device-side assert triggered")
    broken = _FakeCuda(broken=True)
    broken.install(monkeypatch)
    with pytest.raises(HealthCheckError, match=r"synchronize\(\) failed: CUDA error: device-side"):
        ChainedGPUHealthCheck()(state, sticky)
    with pytest.raises(HealthCheckError, match="device-side assert"):
        ChainedGPUHealthCheck()(frozen(state, sticky))  # the newer generation's shape
    # a fault that is no CUDA error costs no synchronization
    other = ValueError("not the GPU's")
    assert ChainedGPUHealthCheck()(state, other) == (state, other)
    assert broken.synchronized == 2
    # a CUDA error that left the context working (not sticky): the rank goes on
    working = _FakeCuda(broken=False)
    working.install(monkeypatch)
    fault = torch.AcceleratorError("CUDA error: invalid configuration argument")
    assert ChainedGPUHealthCheck()(state, fault) == (state, fault)
    assert working.synchronized == 1


def test_nvlink_failure_is_logged_and_ignored(monkeypatch, state, caplog):
    nvml = fake_nvml(monkeypatch, links=(1, 0))
    caplog.set_level(logging.INFO, "inprocess.health_check.restart")
    assert ChainedNVLHealthCheck(device_index=0)(state) is state
    assert "NVLink of GPU 0 degraded (ignored): link 1 inactive" in caplog.text
    assert [c[2] for c in nvml.calls if c[0] == "nvlink"] == [0, 1, 2, 3]
    assert ("shutdown",) in nvml.calls


def test_nic_link_down_is_a_fault_of_the_rank(tmp_path, state):
    ib(tmp_path, {("mlx5_0", 1): 3, ("mlx5_1", 1): 0})
    check = ChainedNicHealthCheck(device_index=0, sysfs_root=str(tmp_path))
    assert check(state) is state
    ib(tmp_path, {("mlx5_1", 1): 2})
    with pytest.raises(HealthCheckError, match="mlx5_1 port 1: link down 2 time"):
        check(state)
    assert check(state) is state  # the new count is the baseline


def test_absent_nvml_or_device_passes_with_a_clear_message(monkeypatch, tmp_path, state, caplog):
    caplog.set_level(logging.INFO, "inprocess.health_check")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert ChainedGPUHealthCheck(0)(state) is state
    assert "pynvml cannot be imported" in caplog.text
    nvl = ChainedNVLHealthCheck(0)
    nvl(state)
    nvl(state)
    said = [r for r in caplog.records if "ChainedNVLHealthCheck checked nothing" in r.message]
    assert len(said) == 1, "said once, not at every restart"
    from inprocess.health_check import restart

    fake_nvml(monkeypatch, count=1)
    assert ChainedNVLHealthCheck(0)(state) is state  # the process's answer is kept
    restart._nvml_absent.cache_clear()  # (a new process would ask again)
    caplog.clear()
    assert ChainedNVLHealthCheck(3)(state) is state
    assert "no GPU 3" in caplog.text
    nic = ChainedNicHealthCheck(sysfs_root=str(tmp_path / "none"))
    assert nic(state) is state
    assert "no InfiniBand port counters" in caplog.text


def test_restart_checks_run_in_the_documented_order(monkeypatch, tmp_path, state):
    from inprocess.health_check import restart

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert restart_health_checks() is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    order = []

    class User(inprocess.health_check.HealthCheck):
        def __init__(self, name):
            self.name = name

        def __call__(self, state):
            order.append(self.name)
            return state

    for cls in (ChainedGPUHealthCheck, ChainedNVLHealthCheck, ChainedNicHealthCheck):
        monkeypatch.setattr(cls, "check", lambda self, c=cls: order.append(c.__name__))
    chained = restart_health_checks(inprocess.Compose(User("user1"), User("user2")), nic=True)
    assert isinstance(chained, inprocess.health_check.HealthCheck)
    assert [type(c).__name__ for c in chained.instances] == [
        "User",
        "User",
        "ChainedGPUHealthCheck",
        "ChainedNVLHealthCheck",
        "ChainedNicHealthCheck",
    ]
    assert chained(state) is state
    assert order == [
        "ChainedNicHealthCheck",
        "ChainedNVLHealthCheck",
        "ChainedGPUHealthCheck",
        "user2",
        "user1",
    ]
    assert generation_of("health_check", restart_health_checks()) is None  # fits either
    # The NIC check is in the chain even where the node has no InfiniBand
    # counters (it passes there); nic=False leaves it out.
    monkeypatch.setattr(restart, "IB_SYSFS", str(tmp_path / "none"))
    monkeypatch.setattr(ChainedNicHealthCheck.__init__, "__defaults__", (None, str(tmp_path)))
    assert len(restart_health_checks().instances) == 3
    assert len(restart_health_checks(nic=False).instances) == 2
    for bad in (-1, "0", True):
        with pytest.raises(ValueError, match="device_index"):
            restart_health_checks(device_index=bad)


@pytest.mark.timeout(120)
def test_wrapper_runs_them_before_the_users_check_and_a_gpu_failure_ends_the_rank(
    single_rank, monkeypatch
):
    import datetime

    ms = datetime.timedelta(milliseconds=1)
    fast = dict(
        monitor_thread_interval=20 * ms,
        monitor_process_interval=20 * ms,
        progress_watchdog_interval=20 * ms,
        last_call_wait=10 * ms,
    )
    order = []

    class UserCheck(inprocess.health_check.HealthCheck):
        def __call__(self, state, train_ex):
            order.append("user")
            return state, train_ex

    def gpu(self):
        order.append("gpu")
        if order.count("gpu") > 1:
            raise HealthCheckError("GPU 0 is unhealthy: fake")

    monkeypatch.setattr(ChainedGPUHealthCheck, "check", gpu)
    monkeypatch.setattr(ChainedNVLHealthCheck, "check", lambda self: order.append("nvlink"))
    monkeypatch.setattr(ChainedNicHealthCheck, "check", lambda self: order.append("nic"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    wrapper = inprocess.Wrapper(health_check=UserCheck(), **fast)
    assert wrapper.restart_health_check is not None

    def train():
        raise ValueError("fault")

    with pytest.raises(HealthCheckError, match="GPU 0 is unhealthy") as info:
        wrapper(train)()
    assert isinstance(info.value.__cause__, ValueError)
    # the first iteration's check is the user's alone; after a fault: NIC,
    # NVLink, GPU, then the user's
    assert order[0] == "user", order
    assert order[1:5] == ["nic", "nvlink", "gpu", "user"], order
    assert order[-1] == "gpu", order
    assert type(wrapper.restart_health_check.instances[0]).__name__ == "UserCheck"

    monkeypatch.delenv("LOCAL_RANK")
    assert inprocess.Wrapper(**fast).restart_health_check is None


class StandIn:
    """A chained check replaced in the Wrapper's module: only device_index and __call__."""

    built: list[tuple[str, int]] = []
    ran: list[str] = []

    def __init__(self, device_index):
        self.device_index = device_index
        StandIn.built.append((type(self).__name__, device_index))

    def __call__(self, state):
        StandIn.ran.append(type(self).__name__)
        return state


class FakeGPU(StandIn):
    pass


class FakeNVL(StandIn):
    pass


class FakeNic(StandIn):
    pass


def test_the_wrappers_chain_is_built_from_the_names_in_its_module(monkeypatch, state):
    import inprocess.wrap

    StandIn.built.clear()
    StandIn.ran.clear()
    monkeypatch.setattr(inprocess.wrap, "ChainedGPUHealthCheck", FakeGPU)
    monkeypatch.setattr(inprocess.wrap, "ChainedNVLHealthCheck", FakeNVL)
    monkeypatch.setattr(inprocess.wrap, "ChainedNicHealthCheck", FakeNic)
    monkeypatch.setenv("LOCAL_RANK", "3")

    class User(inprocess.health_check.HealthCheck):
        def __init__(self, name):
            self.name = name

        def __call__(self, state):
            StandIn.ran.append(self.name)
            return state

    plain = inprocess.Wrapper()
    assert isinstance(plain.restart_health_check, inprocess.Compose)
    # As the newest generation composes it: Compose(user..., gpu, nvl, nic), run
    # the last listed first.
    assert [type(c) for c in plain.restart_health_check.instances] == [FakeGPU, FakeNVL, FakeNic]
    assert sorted(StandIn.built) == [("FakeGPU", 3), ("FakeNVL", 3), ("FakeNic", 3)]
    assert all(c.device_index == 3 for c in plain.restart_health_check.instances)
    assert plain.restart_health_check(state) is state
    assert StandIn.ran == ["FakeNic", "FakeNVL", "FakeGPU"]

    StandIn.ran.clear()
    wrapper = inprocess.Wrapper(health_check=User("user"))
    kinds = [type(c).__name__ for c in wrapper.restart_health_check.instances]
    assert kinds == ["User", "FakeGPU", "FakeNVL", "FakeNic"]
    assert wrapper.restart_health_check(state) is state
    assert StandIn.ran == ["FakeNic", "FakeNVL", "FakeGPU", "user"]

    StandIn.ran.clear()
    wrapper = inprocess.Wrapper(health_check=inprocess.Compose(User("user1"), User("user2")))
    kinds = [type(c).__name__ for c in wrapper.restart_health_check.instances]
    assert kinds == ["User", "User", "FakeGPU", "FakeNVL", "FakeNic"]
    assert wrapper.restart_health_check(state) is state
    assert StandIn.ran == ["FakeNic", "FakeNVL", "FakeGPU", "user2", "user1"]

    monkeypatch.delenv("LOCAL_RANK")
    assert inprocess.Wrapper().restart_health_check is None


def test_the_nic_check_is_in_the_wrappers_chain_without_counters(
    monkeypatch, tmp_path, state, caplog
):
    from inprocess.health_check import restart

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(restart, "IB_SYSFS", str(tmp_path / "none"))
    monkeypatch.setattr(
        ChainedNicHealthCheck.__init__, "__defaults__", (None, str(tmp_path / "none"))
    )
    monkeypatch.setenv("LOCAL_RANK", "0")
    chain = inprocess.Wrapper().restart_health_check
    kinds = [type(c) for c in chain.instances]
    assert kinds == [ChainedGPUHealthCheck, ChainedNVLHealthCheck, ChainedNicHealthCheck]
    with caplog.at_level(logging.INFO, logger="inprocess"):
        assert chain(state) is state
    assert "ChainedNicHealthCheck checked nothing" in caplog.text


def test_a_nic_failure_after_a_cuda_error_still_asks_the_cuda_context(monkeypatch, state):
    """The NIC check runs before the GPU check: when it fails after a sticky CUDA
    error, the rank still learns that its CUDA context is broken before it leaves."""
    import torch

    from inprocess import callbacks, device_fault

    marked: list[str] = []
    monkeypatch.setattr(device_fault, "mark_broken", marked.append)
    fake_nvml(monkeypatch)  # a healthy GPU
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpu_ran: list[int] = []
    monkeypatch.setattr(ChainedGPUHealthCheck, "check", lambda self: gpu_ran.append(1))

    def nic_down(self):
        raise HealthCheckError("NIC health check failed: mlx5_0 port 1: link down 1 time(s)")

    monkeypatch.setattr(ChainedNicHealthCheck, "check", nic_down)
    wrapper = inprocess.Wrapper()
    left: list[str] = []
    run = callbacks.Callbacks(wrapper.config, "rank 0", wrapper.restart_health_check, left.append)
    sticky = torch.AcceleratorError("CUDA error: device-side assert triggered")
    broken = _FakeCuda(broken=True)
    broken.install(monkeypatch)
    with pytest.raises(HealthCheckError, match="NIC health check failed") as info:
        run.restart_health_check(state, sticky)
    assert info.value.__cause__ is sticky
    assert gpu_ran == []  # the chain stopped at the NIC
    assert broken.synchronized == 1
    assert marked == ["CUDA error: device-side assert triggered"]
    assert "GPU fault" in left[0]
    # a working context: the rank leaves for its NIC, nothing is marked
    marked.clear()
    _FakeCuda(broken=False).install(monkeypatch)
    with pytest.raises(HealthCheckError, match="NIC health check failed"):
        run.restart_health_check(state, sticky)
    assert marked == []
