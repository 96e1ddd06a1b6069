"""A daemon thread of ours whose native call returns while the interpreter exits
does not abort the process (``inprocess.native_calls``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from inprocess import native_calls

# A store read that times out 0.6 s after the main thread is done, while the
# interpreter frees a large object at its teardown (about a second): the read
# returns during finalization. Run with THREAD=raw (a plain daemon thread) or
# THREAD=bounded (``call_with_timeout``, which leaves its thread behind).
SCRIPT = textwrap.dedent(
    """
    import datetime, os, threading
    import torch.distributed as dist
    from inprocess.exception import TimeoutError as RestartTimeoutError
    from inprocess.timeouts import call_with_timeout

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)

    def read():
        try:
            client.wait(["never-set"], datetime.timedelta(seconds=0.6))
        except Exception:
            pass

    big = [[i] for i in range(8_000_000)]  # freed at teardown: about a second
    if os.environ["THREAD"] == "raw":
        threading.Thread(target=read, daemon=True).start()
    else:
        try:
            call_with_timeout(read, 0.05, "test-read")
        except RestartTimeoutError:
            pass
    print("main thread done", flush=True)
    """
)


def run(thread: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "THREAD": thread, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(150)
def test_a_left_behind_store_read_ending_at_exit_does_not_abort_the_process():
    # (With THREAD=raw, a plain daemon thread, the process dies of std::terminate.)
    bounded = run("bounded")
    assert bounded.returncode == 0, (bounded.returncode, bounded.stderr[-3000:])
    assert "main thread done" in bounded.stdout
    assert "terminate called" not in bounded.stderr


def test_join_tracked_waits_for_a_tracked_thread_and_reports_one_still_running():
    release = threading.Event()
    quick = native_calls.track(threading.Thread(target=lambda: None, daemon=True))
    slow = native_calls.track(threading.Thread(target=release.wait, daemon=True))
    unstarted = native_calls.track(threading.Thread(target=lambda: None, daemon=True))
    quick.start()
    slow.start()
    try:
        left = native_calls.join_tracked(0.2)
        assert slow in left and quick not in left and unstarted not in left
    finally:
        release.set()
        slow.join(5)
    assert native_calls.join_tracked(1.0) == []
