"""Health checks: FaultCounter, CudaHealthCheck, NVMLHealthCheck (real and fake NVML)."""

from __future__ import annotations

import datetime
import sys
import threading
import types
from typing import Any

import pytest
import torch

from inprocess.compose import Compose
from inprocess.exception import HealthCheckError, RestartError
from inprocess.health_check import (
    CudaHealthCheck,
    FaultCounter,
    FaultCounterExceeded,
    HealthCheck,
    NVMLHealthCheck,
)
from inprocess.monitor_thread import RankShouldRestart
from inprocess.state import State

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def state() -> State:
    return State(rank=3, world_size=8)


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        HealthCheck()


# ---------------------------------------------------------------------- FaultCounter


def test_fault_counter_counts_only_this_ranks_faults(state):
    counter = FaultCounter(max_rank_faults=2)
    ex = ValueError("boom")
    assert counter(state, None) == (state, None)
    assert counter(state, RankShouldRestart())[0] is state  # a remote fault
    assert counter.faults_count == 0
    assert counter(state, ex) == (state, ex)
    assert counter(state, ex) == (state, ex)
    assert counter.faults_count == 2
    with pytest.raises(FaultCounterExceeded, match="3 faults, more than max_rank_faults=2") as info:
        counter(state, ex)
    assert info.value.__cause__ is ex
    assert isinstance(info.value, HealthCheckError)
    assert isinstance(info.value, RestartError)


def test_fault_counter_zero_and_unlimited(state):
    with pytest.raises(FaultCounterExceeded):
        FaultCounter(0)(state, RuntimeError())
    unlimited = FaultCounter()
    for _ in range(100):
        unlimited(state, RuntimeError())
    assert unlimited.faults_count == 100


@pytest.mark.parametrize("bad", [1.5, "3", True])
def test_fault_counter_bad_type(bad):
    with pytest.raises(TypeError, match="max_rank_faults"):
        FaultCounter(bad)


def test_fault_counter_bad_value():
    with pytest.raises(ValueError, match="max_rank_faults"):
        FaultCounter(-1)


# ---------------------------------------------------------------------- CudaHealthCheck


def test_cuda_health_check_passes_without_cuda(state):
    ex = RuntimeError()
    assert CudaHealthCheck()(state, ex) == (state, ex)
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("bad", [5, None, "1s"])
def test_cuda_health_check_bad_timeout_type(bad):
    with pytest.raises(TypeError, match="timeout"):
        CudaHealthCheck(bad)


def test_cuda_health_check_bad_timeout_value():
    with pytest.raises(ValueError, match="timeout"):
        CudaHealthCheck(datetime.timedelta(seconds=-1))


class FakeCuda:
    """Stands in for torch.cuda on a machine without GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 2, current: int = 0):
        self.synchronized: list[int] = []
        self.error: BaseException | None = None
        self.block = threading.Event()
        self.blocking = False
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def synchronize(self, device: int | None = None) -> None:
        if self.blocking:
            self.block.wait(10)
        if self.error is not None:
            raise self.error
        self.synchronized.append(device)


def test_cuda_health_check_synchronizes_local_rank_device(state, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert CudaHealthCheck()(state) == (state, None)
    assert cuda.synchronized == [1]


def test_cuda_health_check_current_device_fallback(state, monkeypatch):
    cuda = FakeCuda(monkeypatch, count=1, current=0)
    monkeypatch.setenv("LOCAL_RANK", "5")  # one visible GPU per process
    CudaHealthCheck()(state)
    monkeypatch.delenv("LOCAL_RANK")
    CudaHealthCheck()(state)
    assert cuda.synchronized == [0, 0]


def test_cuda_health_check_error(state, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cuda.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(HealthCheckError, match="illegal memory access") as info:
        CudaHealthCheck()(state)
    assert info.value.__cause__ is cuda.error


def test_cuda_health_check_timeout(state, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cuda.blocking = True
    try:
        with pytest.raises(HealthCheckError, match=r"did not finish within 0\.1s"):
            CudaHealthCheck(datetime.timedelta(seconds=0.1))(state)
    finally:
        cuda.block.set()  # let the daemon thread end


# ---------------------------------------------------------------------- NVML, this machine


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_nvml_fails_without_nvml(state, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if _nvml_works():
        pytest.skip("this machine has NVML")
    with pytest.raises(HealthCheckError, match="NVML is not available"):
        NVMLHealthCheck()(state)
    assert NVMLHealthCheck(on_missing="skip")(state, None) == (state, None)


def test_nvml_without_pynvml_module(state, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    with pytest.raises(HealthCheckError, match="pynvml cannot be imported"):
        NVMLHealthCheck()(state)
    assert NVMLHealthCheck(on_missing="skip")(state)[0] is state


@pytest.mark.parametrize("bad", ["ignore", None, ""])
def test_nvml_bad_on_missing(bad):
    with pytest.raises(ValueError, match="on_missing must be one of"):
        NVMLHealthCheck(on_missing=bad)


def test_nvml_bad_device_index():
    with pytest.raises(TypeError, match="device_index"):
        NVMLHealthCheck(device_index="0")
    with pytest.raises(ValueError, match="device_index"):
        NVMLHealthCheck(device_index=-1)


# ---------------------------------------------------------------------- NVML, fake module


class FakeNVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


def make_fake_pynvml(
    *,
    count: int = 2,
    init_error: int | None = None,
    pending_pages: int | Exception = 0,
    remapped: tuple[int, int, int, int] | Exception = (0, 0, 0, 0),
    recovery: int = 0,
    recovery_return: int = 0,
    with_recovery_field: bool = True,
    handle_error: int | None = None,
) -> Any:
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_SUCCESS = 0
    nvml.NVML_ERROR_INVALID_ARGUMENT = 2
    nvml.NVML_ERROR_NOT_SUPPORTED = 3
    nvml.NVML_ERROR_NO_PERMISSION = 4
    nvml.NVML_ERROR_LIBRARY_NOT_FOUND = 12
    nvml.NVML_ERROR_FUNCTION_NOT_FOUND = 13
    nvml.NVML_ERROR_GPU_IS_LOST = 15
    nvml.NVML_FEATURE_DISABLED = 0
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.NVML_VALUE_TYPE_UNSIGNED_INT = 1
    nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
    nvml.NVML_GPU_RECOVERY_ACTION_NONE = 0
    nvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
    nvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
    if with_recovery_field:
        nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvml.calls = []

    def record(name: str, *args: Any) -> None:
        nvml.calls.append((name, *args))

    def nvmlInit() -> None:
        record("init")
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def nvmlShutdown() -> None:
        record("shutdown")

    def nvmlDeviceGetCount() -> int:
        return count

    def nvmlDeviceGetHandleByIndex(index: int) -> str:
        record("handle", index)
        if handle_error is not None:
            raise FakeNVMLError(handle_error)
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(uuid: str) -> str:
        record("uuid", uuid)
        return f"uuid:{uuid}"

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: str) -> str:
        return f"parent:{handle}"

    def answer(value: Any) -> Any:
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlDeviceGetRetiredPagesPendingStatus(handle: str) -> int:
        record("pages", handle)
        return answer(pending_pages)

    def nvmlDeviceGetRemappedRows(handle: str) -> tuple[int, int, int, int]:
        record("rows", handle)
        return answer(remapped)

    def nvmlDeviceGetFieldValues(handle: str, fields: list[int]) -> list[Any]:
        record("fields", handle, tuple(fields))
        return [
            types.SimpleNamespace(
                fieldId=fields[0],
                valueType=nvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                nvmlReturn=recovery_return,
                value=types.SimpleNamespace(uiVal=recovery, ullVal=0),
            )
        ]

    for fn in (
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetHandleByUUID,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
        nvmlDeviceGetRetiredPagesPendingStatus,
        nvmlDeviceGetRemappedRows,
        nvmlDeviceGetFieldValues,
    ):
        setattr(nvml, fn.__name__, fn)
    return nvml


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    def install(**kwargs: Any) -> Any:
        nvml = make_fake_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        return nvml

    return install


def names(nvml: Any) -> list[str]:
    return [call[0] for call in nvml.calls]


def test_fake_nvml_healthy(state, fake_nvml):
    nvml = fake_nvml()
    ex = RuntimeError()
    assert NVMLHealthCheck()(state, ex) == (state, ex)
    assert nvml.calls == [
        ("init",),
        ("handle", 0),
        ("pages", "gpu0"),
        ("rows", "gpu0"),
        ("fields", "gpu0", (230,)),
        ("shutdown",),
    ]


def test_fake_nvml_retired_pages_pending(state, fake_nvml):
    nvml = fake_nvml(pending_pages=1)
    with pytest.raises(HealthCheckError, match="GPU 0 is unhealthy: retired memory pages"):
        NVMLHealthCheck()(state)
    assert names(nvml)[-1] == "shutdown"


@pytest.mark.parametrize(
    ("rows", "message"),
    [((0, 1, 1, 0), "row remapping is pending"), ((2, 0, 0, 1), "row remapping failed")],
)
def test_fake_nvml_row_remapping(state, fake_nvml, rows, message):
    nvml = fake_nvml(remapped=rows)
    with pytest.raises(HealthCheckError, match=message):
        NVMLHealthCheck()(state)
    assert names(nvml).count("shutdown") == 1


def test_fake_nvml_several_findings_in_one_message(state, fake_nvml):
    fake_nvml(pending_pages=1, remapped=(0, 0, 1, 1), recovery=2)
    with pytest.raises(HealthCheckError) as info:
        NVMLHealthCheck()(state)
    text = str(info.value)
    assert "retired memory pages" in text and "pending" in text and "failed" in text
    assert "node reboot (NVML_GPU_RECOVERY_ACTION_NODE_REBOOT=2)" in text


def test_fake_nvml_recovery_action(state, fake_nvml):
    fake_nvml(recovery=1)
    with pytest.raises(HealthCheckError, match="recovery action: gpu reset"):
        NVMLHealthCheck()(state)


def test_fake_nvml_unknown_recovery_action(state, fake_nvml):
    fake_nvml(recovery=99)
    with pytest.raises(HealthCheckError, match="unknown action 99"):
        NVMLHealthCheck()(state)


def test_fake_nvml_unsupported_queries_are_skipped(state, fake_nvml):
    nvml = fake_nvml(
        pending_pages=FakeNVMLError(3),  # NOT_SUPPORTED (Ampere and newer)
        remapped=FakeNVMLError(13),  # FUNCTION_NOT_FOUND (old driver)
        recovery=5,
        recovery_return=3,  # the field is not supported: its value is meaningless
    )
    assert NVMLHealthCheck()(state)[0] is state
    assert names(nvml)[-1] == "shutdown"


def test_fake_nvml_without_recovery_field(state, fake_nvml):
    nvml = fake_nvml(with_recovery_field=False)
    NVMLHealthCheck()(state)
    assert "fields" not in names(nvml)


def test_fake_nvml_query_error_is_wrapped(state, fake_nvml):
    nvml = fake_nvml(remapped=FakeNVMLError(15))  # GPU is lost
    with pytest.raises(HealthCheckError, match="fake NVML error 15") as info:
        NVMLHealthCheck(on_missing="skip")(state)
    assert isinstance(info.value.__cause__, FakeNVMLError)
    assert names(nvml)[-1] == "shutdown"


def test_fake_nvml_field_error_is_wrapped(state, fake_nvml):
    fake_nvml(recovery_return=15)
    with pytest.raises(HealthCheckError, match="fake NVML error 15"):
        NVMLHealthCheck()(state)


def test_fake_nvml_unexpected_exception_is_wrapped(state, fake_nvml):
    nvml = fake_nvml()

    def broken(handle: str) -> int:
        raise OSError("driver went away")

    nvml.nvmlDeviceGetRetiredPagesPendingStatus = broken
    with pytest.raises(HealthCheckError, match="driver went away"):
        NVMLHealthCheck()(state)
    assert names(nvml)[-1] == "shutdown"


def test_fake_nvml_lost_gpu_handle_is_unhealthy_not_missing(state, fake_nvml):
    nvml = fake_nvml(handle_error=15)
    with pytest.raises(HealthCheckError, match="health check of CUDA device 0 failed"):
        NVMLHealthCheck(on_missing="skip")(state)
    assert names(nvml) == ["init", "handle", "shutdown"]


def test_fake_nvml_init_failure_is_missing(state, fake_nvml):
    nvml = fake_nvml(init_error=12)
    with pytest.raises(HealthCheckError, match="NVML is not available: nvmlInit failed"):
        NVMLHealthCheck()(state)
    assert NVMLHealthCheck(on_missing="skip")(state)[0] is state
    assert "shutdown" not in names(nvml)


def test_fake_nvml_missing_device(state, fake_nvml):
    nvml = fake_nvml(count=1)
    with pytest.raises(HealthCheckError, match="GPU 3 does not exist"):
        NVMLHealthCheck(device_index=3)(state)
    assert NVMLHealthCheck(device_index=3, on_missing="skip")(state)[0] is state
    assert names(nvml).count("shutdown") == 2


def test_fake_nvml_device_from_local_rank(state, fake_nvml, monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setenv("LOCAL_RANK", "1")
    NVMLHealthCheck()(state)
    NVMLHealthCheck(device_index=0)(state)
    assert [c for c in nvml.calls if c[0] == "handle"] == [("handle", 1), ("handle", 0)]


def test_fake_nvml_cuda_visible_devices(state, fake_nvml, monkeypatch):
    nvml = fake_nvml(count=8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    NVMLHealthCheck()(state)
    assert ("handle", 7) in nvml.calls

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    NVMLHealthCheck()(state)
    assert ("uuid", "GPU-bbbb") in nvml.calls
    assert ("pages", "uuid:GPU-bbbb") in nvml.calls

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cccc")
    NVMLHealthCheck(device_index=0)(state)
    assert ("pages", "parent:uuid:MIG-cccc") in nvml.calls

    with pytest.raises(HealthCheckError, match="not among CUDA_VISIBLE_DEVICES"):
        NVMLHealthCheck(device_index=1)(state)


def test_installed_pynvml_defines_what_the_check_uses():
    pynvml = pytest.importorskip("pynvml")
    for name in (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetFieldValues",
        "NVMLError",
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_FEATURE_ENABLED",
    ):
        assert hasattr(pynvml, name), name


# ---------------------------------------------------------------------- composition


def test_compose_health_checks(state, fake_nvml):
    fake_nvml()
    counter = FaultCounter(max_rank_faults=1)
    check = Compose(NVMLHealthCheck(), CudaHealthCheck(), counter)
    assert isinstance(check, HealthCheck)
    ex = RuntimeError("first")
    assert check(state, ex) == (state, ex)
    assert check(state, None) == (state, None)
    with pytest.raises(FaultCounterExceeded):
        check(state, RuntimeError("second"))


def test_compose_stops_at_the_first_unhealthy_check(state, fake_nvml):
    nvml = fake_nvml(pending_pages=1)
    counter = FaultCounter()
    # the last listed runs first: NVML fails, the counter never runs
    check = Compose(counter, NVMLHealthCheck())
    with pytest.raises(HealthCheckError):
        check(state, RuntimeError())
    assert counter.faults_count == 0
    assert names(nvml)[-1] == "shutdown"
