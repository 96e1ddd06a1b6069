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


def injectors(monkeypatch, world, **kw):
    """Every rank's injector (cancelled before it fires), by rank."""
    hit = {}
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        injector = inject_fault(**kw)
        if injector is not None:
            injector.cancel()
            injector.join()
            hit[rank] = injector
    return hit


def test_ranges_are_drawn_reproducibly_and_alike_on_every_rank(monkeypatch):
    counts, delays = set(), set()
    for seed in range(30):
        kw = dict(faults=[Fault.KILL], num_faults=(1, 3), keep_alive=1, delay=(0.5, 2.0), seed=seed)
        hit = injectors(monkeypatch, 8, **kw)
        again = injectors(monkeypatch, 8, **kw)
        assert {r: i.interval for r, i in hit.items()} == {r: i.interval for r, i in again.items()}
        assert 1 <= len(hit) <= 3 and 0 not in hit
        assert len({i.interval for i in hit.values()}) == 1  # one delay, the same on every rank
        counts.add(len(hit))
        delays |= {i.interval for i in hit.values()}
    assert counts == {1, 2, 3}
    assert all(0.5 <= d <= 2.0 for d in delays) and len(delays) > 10
    # a degenerate range is the plain number
    assert len(injectors(monkeypatch, 8, **{**kw, "num_faults": (2, 2), "delay": 1})) == 2


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
    bad = [
        ({"num_faults": (1,)}, TypeError),
        ({"num_faults": (1, 2.0)}, TypeError),
        ({"num_faults": (3, 1)}, ValueError),
        ({"num_faults": (-1, 1)}, ValueError),
        ({"num_faults": True}, TypeError),
        ({"delay": "1"}, TypeError),
        ({"delay": (0.5, 0.1)}, ValueError),
        ({"delay": (-1, 1)}, ValueError),
        ({"delay": (0.1, None)}, TypeError),
        ({"keep_alive": -1}, ValueError),
        ({"seed": 1.0}, TypeError),
        ({"callback": 3}, TypeError),
    ]
    for kw, error in bad:
        args = {"faults": [Fault.KILL], "num_faults": 1, "keep_alive": 0, "delay": 0.1, "seed": 0}
        name = next(iter(kw))
        with pytest.raises(error, match=rf"inject_fault\({name}=\.\.\.\)"):
            inject_fault(**{**args, **kw})


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
import os, signal, sys, time
# A victim of its own: SIGINT as a fresh interpreter has it, whatever disposition
# or mask the test process had (both are inherited through fork and exec).
inherited = (signal.getsignal(signal.SIGINT),
             signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
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
print("not injected; SIGINT handler and blocked as inherited:", inherited, flush=True)
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
        code = proc.wait(60)
        assert code == expected, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


CALLBACK = """
import os
from inprocess.tools.inject_fault import Fault, inject_fault
os.environ.update(RANK="1", WORLD_SIZE="2")
inject_fault([Fault.TERM], (1, 1), 1, (0.1, 0.2), 0, callback=lambda: print("callback", flush=True))
import time; time.sleep(30)
"""


@pytest.mark.timeout(60)
def test_callback_without_arguments_runs_before_the_fault():
    proc = subprocess.run(
        [sys.executable, "-c", CALLBACK],
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout == "callback\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["STOP", "GIL"])
def test_hang_fault_kinds(fault):
    proc = run_victim(fault)
    try:
        assert proc.stdout.readline().strip() == "armed"
        time.sleep(1.0)
        assert proc.poll() is None  # still there ...
        if fault == "STOP":
            # the fault fires 0.2 s after arming: on a loaded machine its thread
            # may run seconds late, so wait for the stop rather than assume it
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                    break
                time.sleep(0.05)
            assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        else:  # holding the GIL: the main thread's loop never finishes
            time.sleep(1.0)
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


IMPORTING_VICTIM = """
import os, pathlib, sys, tempfile, time
root = pathlib.Path(tempfile.mkdtemp())
(root / "slowly_imported").mkdir()
(root / "slowly_imported" / "__init__.py").write_text(
    "import time\\n"
    "from . import first\\n"
    "end = time.monotonic() + 1.0\\n"
    "while time.monotonic() < end:\\n"
    "    pass\\n"
    "from . import second\\n"
    "done_at = time.monotonic()\\n"
)
(root / "slowly_imported" / "first.py").write_text("")
(root / "slowly_imported" / "second.py").write_text("")
sys.path.insert(0, str(root))
from inprocess.tools.inject_fault import Fault, inject_fault, InjectedFault
os.environ.update(RANK="0", WORLD_SIZE="1")
inject_fault([Fault[sys.argv[1]]], 1, 0, 0.2, 0)
try:
    import slowly_imported
    time.sleep(30)
except InjectedFault:
    module = sys.modules["slowly_imported"]  # an exception inside the import drops it
    assert module.done_at and module.first and module.second
    print("after the import", flush=True); sys.exit(11)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["ASYNC_EXC", "SIGNAL_EXC"])
def test_an_injected_exception_waits_for_an_import_to_finish(fault):
    """The injected exception stands for a recoverable fault: inside an import it
    would leave the package half-imported for the rest of the process."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTING_VICTIM, fault],
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 11, proc.stdout + proc.stderr
    assert proc.stdout == "after the import\n"
