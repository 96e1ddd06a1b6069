"""CPU cost of sealing and opening store records (:mod:`inprocess.security`).

Every value the restart protocol writes carries a MAC; every read checks it.
This measures the CPU side alone (the store round trips are unchanged in
number where a value only gained a MAC; see ``restart_latency.py`` for a whole
restart): one record sealed, one opened, and a list of N entries opened (what a
decider reads: a fault log or the arrivals of N ranks).

    python benchmarks/record_mac.py [--entries 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from inprocess import protocol as P
from inprocess import security


def per_call(fn, n: int, repeat: int) -> tuple[float, float]:
    """Median and worst seconds per call over ``repeat`` rounds of ``n`` calls."""
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n)
    return statistics.median(rounds), max(rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    os.environ[security.JOB_SECRET_ENV] = "benchmark-secret"
    # a real key: a termination barrier's arrivals, under a job's call namespace
    role = P.role_namespace("job-x/g0/0123456789abcdef0123456789abcdef")
    key = f"{P.call_namespace(role, 0)}/{P.arrivals_key(P.iteration_key(3, P.TERMINATION))}"
    text = "12/0.0123456789="
    record = security.seal(key, text)
    listing = "".join(security.seal(key, f"{i}/0.0123456789=rank") for i in range(args.entries))
    results = {
        "seal_us": per_call(lambda: security.seal(key, text), 20000, args.repeat),
        "open_one_us": per_call(lambda: security.open_records(key, record), 20000, args.repeat),
        f"open_{args.entries}_ms": per_call(
            lambda: security.open_records(key, listing), 20, args.repeat
        ),
    }
    for name, (median, worst) in results.items():
        scale = 1e3 if name.endswith("_ms") else 1e6
        print(
            json.dumps(
                {"what": name, "median": round(median * scale, 3), "worst": round(worst * scale, 3)}
            )
        )
    print(json.dumps({"record_bytes": len(record), "text_bytes": len(text)}))


if __name__ == "__main__":
    main()
