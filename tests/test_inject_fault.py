"""inprocess.tools.inject_fault: one draw on every rank; each fault does what it says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from inprocess.tools.inject_fault import GPU_FAULTS, Fault, inject_fault


def victims(monkeypatch, world, **kw):
    hit = {}
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        injector = inject_fault(delay=3600, **kw)
        if injector is not None:
            injector.cancel()
            injector.join()
            hit[rank] = injector.fault
    return hit


def test_every_rank_draws_the_same_victims(monkeypatch):
    kinds = [Fault.ASYNC_EXC, Fault.KILL, Fault.TERM]
    first = victims(monkeypatch, 16, faults=kinds, num_faults=3, keep_alive=2, seed=7)
    again = victims(monkeypatch, 16, faults=kinds, num_faults=3, keep_alive=2, seed=7)
    assert first == again and len(first) == 3
    assert all(rank >= 2 for rank in first)
    assert set(first.values()) <= set(kinds)
    other = victims(monkeypatch, 16, faults=kinds, num_faults=3, keep_alive=2, seed=8)
    assert other != first  # a different seed, a different draw (for these seeds)
    assert victims(monkeypatch, 4, faults=kinds, num_faults=9, keep_alive=1, seed=0).keys() == {
        1, 2, 3
    }


def test_bad_arguments(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="faults"):
        inject_fault([], 1, 0, 0.1, 0)
    with pytest.raises(TypeError, match="faults"):
        inject_fault(["KILL"], 1, 0, 0.1, 0)
    with pytest.raises(ValueError, match="delay"):
        inject_fault([Fault.KILL], 1, 0, -1, 0)
    with pytest.raises(TypeError, match="num_faults"):
        inject_fault([Fault.KILL], 1.5, 0, 0.1, 0)


def test_gpu_faults_need_a_gpu(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for fault in GPU_FAULTS:
        with pytest.raises(RuntimeError, match="CUDA device"):
            inject_fault([fault], 1, 0, 0.1, 0)


VICTIM = """
import os, sys, time
from inprocess.tools.inject_fault import Fault, inject_fault, InjectedFault
os.environ.update(RANK="0", WORLD_SIZE="1")
inject_fault([Fault[sys.argv[1]]], 1, 0, 0.2, 0)
print("armed", flush=True)
try:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        time.sleep(0.01)
except InjectedFault:
    print("InjectedFault", flush=True); sys.exit(11)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True); sys.exit(12)
print("not injected", flush=True)
"""


def run_victim(fault: str, timeout: float = 30):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, fault],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return proc


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("ASYNC_EXC", 11),
        ("SIGNAL_EXC", 11),
        ("INT", 12),
        ("ABORT", -signal.SIGABRT),
        ("SEGFAULT", -signal.SIGSEGV),
        ("KILL", -signal.SIGKILL),
        ("TERM", -signal.SIGTERM),
    ],
)
def test_fault_kinds(fault, expected):
    proc = run_victim(fault)
    try:
        assert proc.wait(60) == expected
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["STOP", "GIL"])
def test_hang_fault_kinds(fault):
    proc = run_victim(fault)
    try:
        assert proc.stdout.readline().strip() == "armed"
        time.sleep(1.0)
        assert proc.poll() is None  # still there ...
        status = psutil.Process(proc.pid).status()
        if fault == "STOP":
            assert status == psutil.STATUS_STOPPED
        else:  # holding the GIL: the main thread's loop never finishes
            time.sleep(1.0)
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
