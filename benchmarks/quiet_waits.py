"""A blocking store wait's cost: torch's timed ``wait`` against the library's own
(:mod:`inprocess.quiet_wait`), side by side in one run.

Over one ``TCPStore`` server in a process of its own (as in ``restart_scale.py``):

* a long wait: a waiter waits for a key nobody sets, in ``--chunk`` second
  chunks, for ``--seconds``: the server's operations (read system calls) and
  the warning lines torch's client printed (to file descriptor 2, counted);
* wake-up latency: a waiter blocks on a key, another client sets it;
  ``--wakes`` times, the time from just before the ``set`` to the waiter's return.

    PYTHONPATH=. python benchmarks/quiet_waits.py --seconds 12 --chunk 0.5 --wakes 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# torch's default level (restart_scale quiets it): its warnings are what is counted
os.environ["TORCH_CPP_LOG_LEVEL"] = "WARNING"
from restart_scale import HOST, serve, server_io

from inprocess.store import PrefixStore, TCPStore


def torch_wait(store: PrefixStore, key: str, seconds: float) -> bool:
    """torch's own timed wait, as the library made it before."""
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
        return True
    except Exception:
        return False


def long_wait(waiter, store: PrefixStore, pid: int, seconds: float, chunk: float) -> dict:
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            _, ops0, _ = server_io(pid)
            end, chunks = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                waiter(store, f"never/{id(waiter)}", chunk)
                chunks += 1
            _, ops1, _ = server_io(pid)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        lines = err.read().decode(errors="replace").count("waitForInput")
    return {"chunks": chunks, "server_ops": ops1 - ops0, "torch_warning_lines": lines}


def wake_latency(waiter, store: PrefixStore, setter: PrefixStore, wakes: int) -> dict:
    def wake(key: str, set_at: list[float]) -> None:
        time.sleep(0.05)  # the waiter is blocked by now
        set_at.append(time.perf_counter())
        setter.set(key, "1")

    latencies = []
    for k in range(wakes):
        key, set_at = f"wake/{id(waiter)}/{k}", []
        thread = threading.Thread(target=wake, args=(key, set_at))
        thread.start()
        assert waiter(store, key, 10.0)
        latencies.append(time.perf_counter() - set_at[0])
        thread.join()
    return {
        "wake_median_ms": round(statistics.median(latencies) * 1000, 3),
        "wake_max_ms": round(max(latencies) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of the long wait")
    parser.add_argument("--chunk", type=float, default=0.5, help="seconds per wait chunk")
    parser.add_argument("--wakes", type=int, default=40)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(queue, stop), daemon=True)
    server.start()
    pid, port = queue.get(timeout=120)
    try:
        store = PrefixStore("bench", TCPStore(host_name=HOST, port=port, is_master=False))
        setter = PrefixStore("bench", TCPStore(host_name=HOST, port=port, is_master=False))
        store.wait_for("warm-up", 0.01)  # the quiet wait's connection, outside the figures
        for name, waiter in (("torch wait", torch_wait), ("quiet wait", PrefixStore.wait_for)):
            result = {"wait": name, "seconds": args.seconds, "chunk_s": args.chunk}
            result.update(long_wait(waiter, store, pid, args.seconds, args.chunk))
            result.update(wake_latency(waiter, store, setter, args.wakes))
            print(json.dumps(result), flush=True)
    finally:
        stop.set()
        server.join(30)


if __name__ == "__main__":
    main()
