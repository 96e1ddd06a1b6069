"""The GPU path for real, on a machine with an NVIDIA GPU: the NCCL abort, CudaHealthCheck
and NVMLHealthCheck, as a restart runs them.

    python benchmarks/gpu_checks.py [nvml] [cuda] [nccl]   # one JSON object per line

* ``nccl_abort``: two ranks (processes) form an NCCL group on GPU 0. Rank 1
  never enters a collective, so rank 0's first ``all_reduce`` waits in the
  communicator's setup for a peer that will not come (what a rank sees when a
  peer died before the collective). Another thread of rank 0 runs
  :class:`inprocess.abort.AbortTorchDistributed` (what the Wrapper's restart
  runs) 2 s into the wait. Reports whether and when the ``all_reduce``
  returned, what it raised, and whether the process then forms a new NCCL
  group and reduces on it (what the next iteration does). Run twice: as
  torch sets up communicators by default, then with
  ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` (each bounded: 150 s for rank 0's
  report, then its processes are killed).
* ``cuda_health``: :class:`inprocess.health_check.CudaHealthCheck` on a GPU
  that drained (passes), on a GPU busy with a kernel for 10 s with a 2 s
  timeout (fails in about 2 s: a hung GPU), and after a device-side assert (a
  sticky error: fails with CUDA's message). Each in a process of its own.
* ``nvml_health``: :class:`inprocess.health_check.NVMLHealthCheck` on GPU 0
  (passes on a healthy GPU; what it costs).

Without a GPU every check reports ``skipped``. Results: ``results/gpu_checks.txt``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

HOST = "127.0.0.1"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _exit_after(out: Any, result: dict[str, Any]) -> None:
    """Hands ``result`` over (flushed: a queue sends from a thread of its own), then
    ends the process at once: a communicator half set up, or a kernel still
    running, must not hold the exit."""
    out.put(result)
    out.close()
    out.join_thread()
    os._exit(0)


# ----------------------------------------------------------------------------- NCCL abort


def nccl_rank(rank: int, port: int, out: Any, env: dict[str, str]) -> None:
    """One rank of the two-rank NCCL group (see the module docstring)."""
    os.environ.update(env)  # before torch reads it

    import torch
    import torch.distributed as dist

    from inprocess.abort import AbortTorchDistributed
    from inprocess.state import State
    from inprocess.store import PrefixStore, TCPStore

    torch.cuda.set_device(0)
    store = TCPStore(host_name=HOST, port=port, is_master=False, timeout=_td(60))
    dist.init_process_group(
        "nccl", store=PrefixStore("first", store), rank=rank, world_size=2, timeout=_td(60)
    )
    if rank == 1:
        # in the group, never in a collective: rank 0's waits for it
        store.wait(["done"], _td(120))
        os._exit(0)
    result: dict[str, Any] = {"check": "nccl_abort", "torch": torch.__version__}
    result["nccl"] = str(torch.cuda.nccl.version())
    returned: dict[str, Any] = {}

    def collective() -> None:
        started = time.monotonic()
        try:
            tensor = torch.ones(1, device="cuda")
            dist.all_reduce(tensor)
            torch.cuda.synchronize()
            returned["value"] = float(tensor.item())
        except BaseException as ex:  # what the abort makes of it is the finding
            returned["raised"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        returned["at"] = time.monotonic()
        returned["waited_s"] = round(time.monotonic() - started, 3)

    thread = threading.Thread(target=collective, daemon=True)
    thread.start()
    time.sleep(2.0)
    result["blocked_before_abort"] = thread.is_alive()
    aborted = time.monotonic()
    try:
        AbortTorchDistributed()(State(rank=0, world_size=2))
        result["abort_s"] = round(time.monotonic() - aborted, 3)
    except BaseException as ex:
        result["abort_raised"] = f"{type(ex).__name__}: {ex}"
    thread.join(30)
    result["collective_returned"] = not thread.is_alive()
    if not thread.is_alive():
        result["returned_after_abort_s"] = round(returned["at"] - aborted, 3)
        result.update({k: v for k, v in returned.items() if k != "at"})
    result["initialized_after_abort"] = dist.is_initialized()
    # the next iteration: a new group (here of one rank) and a collective on it
    try:
        started = time.monotonic()
        dist.init_process_group(
            "nccl", store=PrefixStore("second", store), rank=0, world_size=1, timeout=_td(60)
        )
        tensor = torch.full((1,), 3.0, device="cuda")
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        took = time.monotonic() - started
        result["next_group"] = f"all_reduce gave {tensor.item()} in {took:.3f}s"
        dist.destroy_process_group()
    except BaseException as ex:
        result["next_group"] = f"{type(ex).__name__}: {str(ex)[:300]}"
    store.set("done", "1")
    _exit_after(out, result)  # a communicator left half set up must not hold the exit


def nccl_abort(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The NCCL check; ``env``: variables its ranks set before torch is imported
    (e.g. torch's ``TORCH_NCCL_USE_COMM_NONBLOCKING``)."""
    from inprocess._net import free_port
    from inprocess.store import TCPStore

    env = env or {}
    port = free_port()
    server = TCPStore(host_name=HOST, port=port, is_master=True, timeout=_td(120))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=nccl_rank, args=(r, port, out, env)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        result = out.get(timeout=150)
    except Exception:
        result = {"check": "nccl_abort", "error": "rank 0 reported nothing within 150 s"}
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
        del server
    if env:
        result["env"] = env
    return result


# ----------------------------------------------------------------------------- health checks


def cuda_case(case: str, out: Any) -> None:
    """One CudaHealthCheck case in a process of its own (a sticky error ends a context)."""
    import torch

    from inprocess.exception import HealthCheckError
    from inprocess.health_check import CudaHealthCheck
    from inprocess.state import State

    torch.cuda.set_device(0)
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()  # CUDA initialized, some work done and drained
    timeout = 2.0
    if case == "busy":
        torch.cuda._sleep(int(2e10))  # 2e10 cycles: about 10 s at 2 GHz
    elif case == "sticky":
        index = torch.tensor([1 << 20], device="cuda")
        try:
            a[index, 0] = 1.0  # out of bounds: a device-side assert
        except Exception:
            pass
    check = CudaHealthCheck(timeout=_td(timeout))
    started = time.monotonic()
    try:
        check(State(rank=0, world_size=1), None)
        verdict = "passed"
    except HealthCheckError as ex:
        verdict = f"HealthCheckError: {str(ex)[:300]}"
    result = {"check": "cuda_health", "case": case, "timeout_s": timeout, "verdict": verdict}
    result["took_s"] = round(time.monotonic() - started, 3)
    _exit_after(out, result)  # a busy GPU: the kernel need not finish first


def cuda_health() -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    found = []
    for case in ("drained", "busy", "sticky"):
        if found:
            print(json.dumps(found[-1]), flush=True)
        out = ctx.Queue()
        process = ctx.Process(target=cuda_case, args=(case, out))
        process.start()
        try:
            found.append(out.get(timeout=90))
        except Exception:
            found.append({"check": "cuda_health", "case": case, "error": "no answer in 90 s"})
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
    return found[-1:]


def nvml_health() -> dict[str, Any]:
    from inprocess.exception import HealthCheckError
    from inprocess.health_check import NVMLHealthCheck
    from inprocess.state import State

    started = time.monotonic()
    try:
        NVMLHealthCheck(device_index=0)(State(rank=0, world_size=1), None)
        verdict = "passed"
    except HealthCheckError as ex:
        verdict = f"HealthCheckError: {ex}"
    result = {"check": "nvml_health", "verdict": verdict}
    result["took_s"] = round(time.monotonic() - started, 3)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        result["gpu"] = name.decode() if isinstance(name, bytes) else name
        result["driver"] = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception as ex:
        result["gpu"] = f"not read: {ex}"
    return result


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"check": "all", "skipped": "no CUDA device"}), flush=True)
        return
    only = sys.argv[1:] or ["nvml", "cuda", "nccl"]
    if "nvml" in only:
        print(json.dumps(nvml_health()), flush=True)
    if "cuda" in only:
        for result in cuda_health():
            print(json.dumps(result), flush=True)
    if "nccl" in only:
        print(json.dumps(nccl_abort()), flush=True)
        # the communicator set up without blocking: an abort can reach it
        print(json.dumps(nccl_abort({"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"})), flush=True)


if __name__ == "__main__":
    sys.exit(main())
