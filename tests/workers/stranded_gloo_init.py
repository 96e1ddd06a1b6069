"""Rank 0 of a 2-rank gloo group whose peer published its address and stopped.

Usage: ``stranded_gloo_init.py OUT``. Starts rank 1 as a child process that
initializes the group first and SIGSTOPs itself once it has published its
address (its main thread inside gloo's constructor for a while); then rank 0
initializes with a 10 s timeout while a thread calls
``complete_stranded_gloo_init`` as the monitor thread does after an interrupt.
Where rank 0 is the listening side of the pair, gloo would wait for the
stopped peer for 5 x 10 s; the release must end the wait at once. Writes
the attempts (``{"seconds", "released", "error"}``) to OUT as JSON; the side
of the pair is decided by the ports, so it tries until rank 0 was the
listening side once (at most 10 times).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from inprocess._net import free_port
from inprocess.abort import rendezvous
from inprocess.abort.sockets import socket_inodes

PEER = """
import datetime, os, signal, sys, threading, time
import torch.distributed as dist
main = threading.main_thread().ident

def stop_once_inside():
    while sys._current_frames()[main].f_code.co_name != "_new_process_group_helper":
        time.sleep(0.01)
    time.sleep(1.0)  # its address is published; it waits for rank 0's
    os.kill(os.getpid(), signal.SIGSTOP)

threading.Thread(target=stop_once_inside, daemon=True).start()
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False)
dist.init_process_group("gloo", store=store, rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=10))
"""


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def attempt() -> dict:
    """One group with a stopped peer; how long rank 0's initialization took."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)])
    released, error, seconds = 0, None, None
    try:
        deadline = time.monotonic() + 60
        while not stopped(peer.pid):
            if peer.poll() is not None or time.monotonic() > deadline:
                return {"seconds": None, "released": 0, "error": f"peer: {peer.poll()}"}
            time.sleep(0.05)
        rendezvous._baseline = set(socket_inodes())  # as inside the wrapped function
        done = threading.Event()
        main_thread = threading.get_ident()

        def monitor() -> None:  # the monitor thread's re-sends, every 0.1 s
            nonlocal released
            while not done.wait(0.1):
                released += rendezvous.complete_stranded_gloo_init(main_thread)

        helper = threading.Thread(target=monitor)
        helper.start()
        start = time.monotonic()
        try:
            dist.init_process_group(
                "gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=10)
            )
        except RuntimeError as ex:
            error = str(ex)[:200]
        seconds = time.monotonic() - start
        done.set()
        helper.join()
    finally:
        peer.kill()
        peer.wait()
        rendezvous._baseline = None
        rendezvous.close_stranded_connections()
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"seconds": seconds, "released": released, "error": error}


def main() -> None:
    # Which side of the pair rank 0 is depends on the listeners' ports: try
    # until it was the listening side (the release was needed) once.
    attempts = []
    for _ in range(10):
        attempts.append(attempt())
        if attempts[-1]["released"]:
            break
    with open(sys.argv[1], "w") as f:
        json.dump(attempts, f)
    os._exit(0)


if __name__ == "__main__":
    main()
