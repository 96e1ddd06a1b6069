"""A forked standby's prefault (``inprocess/failover/prefault.py``): which
mappings it takes, that it makes the pages a child shares with its parent the
child's own without changing them, and that it yields at once to a readable
socket. Real forked processes, without torch (the module is loaded by path)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[1] / "inprocess" / "failover" / "prefault.py"

SMAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Rss:                 132 kB
Shared_Clean:          0 kB
Shared_Dirty:        128 kB
Private_Dirty:         4 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Rss:                   8 kB
Shared_Clean:          0 kB
Shared_Dirty:          0 kB
Private_Dirty:         8 kB
7f0000100000-7f0000200000 r--p 00000000 08:01 42                         /usr/lib/libc.so.6
Shared_Clean:        400 kB
Shared_Dirty:          0 kB
7f0000200000-7f0000300000 rw-s 00000000 00:05 7                          /dev/shm/x
Shared_Dirty:         64 kB
7f0000300000-7f0000301000 rw-p 00010000 08:01 42                         /usr/lib/libc.so.6
Shared_Clean:          4 kB
Shared_Dirty:          0 kB
7ffd00000000-7ffd00002000 r--p 00000000 00:00 0                          [vvar]
Shared_Dirty:          8 kB
VmFlags: rd wr mr mw me ac sd
"""


def _module():
    spec = importlib.util.spec_from_file_location("prefault_under_test", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_private_writable_mappings_with_shared_pages_are_taken():
    regions = _module().shared_writable_regions(SMAPS.splitlines())
    # the heap (shared dirty pages) and libc's data (a shared clean page); not a
    # mapping with no shared page, a read-only one, a shared one or [vvar]
    assert regions == [(0x55D0C0000000, 0x55D0C0021000), (0x7F0000300000, 0x7F0000301000)]


CHILD = """\
import importlib.util, json, os, socket, sys
spec = importlib.util.spec_from_file_location("prefault", sys.argv[1])
prefault = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prefault)
data = bytearray(os.urandom(1 << 20)) * 48          # 48 MiB written by the parent
digest = hash(bytes(data))

def private_dirty_kb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])

out = {}
for case in ("idle", "assigned"):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ours, theirs = socket.socketpair()
        if case == "assigned":
            theirs.sendall(b"x")                     # the assignment is already there
        before = private_dirty_kb()
        done, seconds = prefault.prefault(ours)
        seen = {"before": before, "after": private_dirty_kb(), "done": done,
                "same": hash(bytes(data)) == digest}
        os.write(w, json.dumps(seen).encode())
        os._exit(0)
    os.close(w)
    out[case] = json.loads(os.read(r, 1 << 16))
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_prefault_makes_shared_pages_private_and_yields_to_the_socket():
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(MODULE)], capture_output=True, text=True, timeout=100
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    idle, assigned = out["idle"], out["assigned"]
    # a fork shares the parent's 48 MiB; after the prefault they are the child's own,
    # with the same bytes
    assert idle["before"] < 16 * 1024, idle
    assert idle["after"] - idle["before"] >= 40 * 1024, idle
    assert idle["done"] >= 48 << 20 and idle["same"], idle
    # with its socket readable a standby does not prefault at all
    assert assigned["done"] == 0 and assigned["after"] - assigned["before"] < 8 * 1024, assigned
