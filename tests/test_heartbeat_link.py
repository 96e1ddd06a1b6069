"""The node agents' heartbeat link (how the Ray backend sees a node lost without Ray).

Real processes and sockets: the agent's side runs in a child process, which is
busy (slow but live: not lost), SIGKILLed (lost at once) or SIGSTOPped (lost
after the silence limit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from inprocess.failover.backends.heartbeat import HeartbeatWatch

# The agent: a heartbeat thread, and a main thread busy in long calls (as a Ray
# actor's method would be), which must not silence it.
AGENT = """
import sys, time
from inprocess.failover.backends.heartbeat import HeartbeatServer
server = HeartbeatServer("127.0.0.1")
print(server.address[1], flush=True)
while True:
    sum(range(10**6))  # busy, holding the GIL between switches (a C call of ~0.1 s)
"""


def _agent(silence: float = 2.0):
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    port = int(proc.stdout.readline())
    return proc, HeartbeatWatch(("127.0.0.1", port), silence=silence)


def _first_loss(watch, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if watch.check() is not None:
            return watch.lost
        time.sleep(0.05)
    return None


@pytest.mark.timeout(60)
def test_busy_agent_is_not_lost_a_dead_one_is_at_once():
    # A silence limit above the product's 2 s: a loaded machine can starve any
    # process that long, busy or not; the busy main thread must cost nothing.
    proc, watch = _agent(silence=6.0)
    try:
        assert _first_loss(watch, 9.0) is None  # busy but beating: 1.5x the silence limit
        killed = time.monotonic()
        proc.kill()
        assert "closed" in (_first_loss(watch, 10.0) or "")
        assert time.monotonic() - killed < 1.5  # the connection's end, not the silence
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        watch.close()


@pytest.mark.timeout(60)
def test_stopped_agent_is_lost_after_the_silence():
    # a longer silence limit than the product's 2 s: before the SIGSTOP the agent
    # must not look lost, and a loaded machine can starve its beats that long
    proc, watch = _agent(silence=5.0)
    try:
        assert _first_loss(watch, 1.0) is None
        stopped = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)
        assert "no heartbeat" in (_first_loss(watch, 30.0) or "")
        assert time.monotonic() - stopped >= 4.0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        watch.close()


@pytest.mark.timeout(30)
def test_a_slow_observer_does_not_see_silence():
    """Beats that waited in the socket while the observer was busy count on reading."""
    proc, watch = _agent()
    try:
        time.sleep(3.0)  # the controller was busy longer than the silence limit
        assert watch.check() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        watch.close()
