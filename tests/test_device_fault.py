"""A rank whose GPU faulted ends cleanly (issue 37, item 3), with stand-ins for a
broken CUDA context: no GPU is needed (``benchmarks/gpu_state.py`` runs the real
device-side assert on one)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from launcher import Job

from inprocess import device_fault
from inprocess.failover import policy, state
from inprocess.snapshot.buffers import HostSnapshot, use_staging


def test_the_cause_is_read_from_the_exception_chain():
    assert device_fault.cause_of(None) is None
    assert device_fault.cause_of(ValueError("x")) is None
    text = "CUDA error: device-side assert triggered\nCUDA kernel errors might be ..."
    assert device_fault.cause_of(torch.AcceleratorError(text)) == (
        "CUDA error: device-side assert triggered"
    )
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("health check failed") from inner
    except ValueError as outer:
        assert device_fault.cause_of(outer) == (
            "CUDA error: an illegal memory access was encountered"
        )
    # a type torch raises for a failed accelerator call, whatever its text
    assert device_fault.cause_of(torch.AcceleratorError("unknown error")) == "unknown error"


def test_the_controller_names_the_exit_code():
    assert state.GPU_FAULT_EXIT_CODE == device_fault.EXIT_CODE
    code = device_fault.EXIT_CODE
    described = policy.WorkerExited(0, 0, code, None, gpu=True).describe()
    assert described == f"exited with code {code} (its GPU faulted)"
    assert policy.WorkerExited(0, 0, code, None, gpu=False).describe() == f"exited with code {code}"


class _Broken:
    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_releasing_a_snapshot_whose_copy_broke_does_not_raise(monkeypatch):
    kept: list[object] = []
    monkeypatch.setattr(device_fault, "_kept", kept)
    monkeypatch.setattr(device_fault, "_broken", None)
    snap = HostSnapshot()
    snap.fill(1, 0, {"w": torch.arange(8.0)})
    data = snap.data
    snap._event, snap._pending_step = _Broken(), 2
    snap.release()  # no AcceleratorError over the error that ended the rank
    assert device_fault.broken() == "CUDA error: device-side assert triggered"
    assert snap.step is None and snap.data.numel() == 0
    assert kept and kept[0] is data  # the buffer the copy may still write: never freed
    # (this process must not end with the device fault's exit code)
    monkeypatch.setattr(device_fault, "_broken", None)


@pytest.mark.parametrize(
    ("setting", "nbytes", "free", "total", "expected"),
    [
        (None, 2 * 2**30, 40 * 2**30, 80 * 2**30, True),  # room to spare
        (None, 2 * 2**30, 9 * 2**30, 80 * 2**30, False),  # would eat the tenth kept free
        (None, 2 * 2**30, 10 * 2**30, 80 * 2**30, True),
        (False, 1, 80 * 2**30, 80 * 2**30, False),  # the user's word
        (True, 2 * 2**30, 0, 80 * 2**30, True),
    ],
)
def test_staging_policy(setting, nbytes, free, total, expected):
    assert use_staging(setting, nbytes, free, total) is expected


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", ["stand-in", "builtin"])
def test_a_rank_whose_gpu_faulted_ends_with_the_health_checks_error(tmp_path, check):
    """With the user's CUDA check (a stand-in), and with none: the Wrapper's own GPU
    check asks the context after a CUDA error (NVML would find the GPU healthy)."""
    args = [str(tmp_path)] + (["builtin"] if check == "builtin" else [])
    with Job("gpu_fault.py", 2, tmp_path, args=args) as job:
        result = job.wait(180)
    out = {r.rank: r.output for r in result.ranks}
    # The survivor goes on without the faulted rank and completes.
    assert result.returncodes[0] == 0, result.describe()
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    # steps 1-2 at world size 2 (+2 each), restored at step 2, steps 3-4 alone (+1 each)
    assert survivor["result"] == 6.0, survivor
    assert survivor["iterations"] == [
        {"iteration": 0, "restored": 0},
        {"iteration": 1, "restored": 2},
    ], survivor
    # The faulted rank: the documented exit code, no abort at exit...
    assert result.returncodes[1] == device_fault.EXIT_CODE, result.describe()
    assert "terminate called" not in out[1], out[1]
    # ...its user's atexit functions ran...
    assert json.loads((tmp_path / "rank1.json").read_text())["atexit"] is True
    # ...and its final exception is the health check's, not the cleanup's CUDA error.
    traceback = out[1][out[1].rindex("Traceback (most recent call last)") :]
    lines = [line.removeprefix("[rank1]: ") for line in traceback.splitlines()]
    last = [line for line in lines if re.match(r"[A-Za-z_][\w.]*: ", line)][-1]
    assert last.startswith("inprocess.exception.HealthCheckError: "), traceback
    assert "device-side assert triggered" in last
    assert "GPU fault (CUDA error: device-side assert triggered)" in out[1]
    assert not result.leftovers, result.leftovers
