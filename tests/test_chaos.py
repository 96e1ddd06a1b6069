"""Chaos test (issue 9): seeded random SIGKILL / SIGSTOP / SIGTERM / exception faults
on the workers, the controller and the store server of a 2 nodes x 2 workers job
under ``inprocess-run``. Every run ends with exit 0 and the exact step count, or
a non-zero exit with a recorded reason, in bounded time, with nothing left running.

The harness is ``benchmarks/chaos_soak.py`` (its longer soak is a benchmark).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos_soak.py"
_spec = importlib.util.spec_from_file_location("chaos_soak", _PATH)
assert _spec is not None and _spec.loader is not None
chaos = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("chaos_soak", chaos)
_spec.loader.exec_module(chaos)


# One run in the suite: seed 45 with 4 faults stops a worker, raises in a
# worker, SIGTERMs the store server and SIGKILLs the controller (the plan is
# drawn from the seed alone: ``benchmarks/chaos_soak.py --seed 45 --faults 4``).
# INPROCESS_CHAOS_SEEDS=0,4,15 (comma-separated) runs those seeds instead, one
# test each (3 faults each: every target and kind between them); the soak
# benchmark runs many more.
_SEEDS_ENV = os.environ.get("INPROCESS_CHAOS_SEEDS", "")
SEEDS = tuple(int(s) for s in _SEEDS_ENV.split(",") if s.strip()) or (45,)
FAULTS = 3 if _SEEDS_ENV else 4


@pytest.mark.timeout(560)
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos(tmp_path, seed):
    # Detection timeouts x3: this run shares the machine with the suite's other
    # jobs, and what it checks is the outcome, not how fast hangs are seen
    # (the soak benchmark runs them at x1).
    result = chaos.run_one(seed, tmp_path, faults=FAULTS, steps=300, deadline=500, time_scale=3.0)
    print(result.summary())
    assert result.ok, result.summary()
    assert result.faults, "the run injected no fault"

