#!/usr/bin/env bash
# Runs the whole test suite (installs what it needs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# torch's store server resolves every client's name for its logs; where DNS is
# unreachable that stalls it for the resolver timeout (5 s). Keep it short.
export RES_OPTIONS="${RES_OPTIONS:-timeout:1 attempts:1}"
.venv/bin/python -m ruff check inprocess tests benchmarks examples
# Two workers, one per core: a run keeps both busy (every fresh process's
# `import torch` costs seconds of CPU), so more would only add load. TEST_WORKERS=0
# runs serially.
# loadgroup: the tests of one xdist_group run on one worker; the others are
# spread as usual. (With pytest 9, pytest-xdist 3.8's grouping has no effect:
# it renames a test's node id where pytest 9 no longer reads it. No test run
# here with -n relies on it, and a module fixture may be made on both workers.)
# The Ray tests run afterwards, on their own: their 4-node Ray cluster (raylets,
# agents, worker pools, every one a Python process) loads a 2-core machine so
# much that the jobs of the tests beside it miss their timeouts.
# A cap on that phase (TEST_PHASE_LIMIT seconds): should pytest-xdist hang after a
# worker crash (seen once: both workers idle, waiting for work), SIGINT makes it
# print what ran and failed so far, and the Ray tests still run.
status=0
timeout --signal=INT --kill-after=120 "${TEST_PHASE_LIMIT:-4600}" \
    .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup -m "not ray" "$@" \
    || status=$?
ray_status=0
.venv/bin/python -m pytest -m ray "$@" || ray_status=$?
# 5: nothing selected (a selection of tests without Ray ones, or without the others)
[ "$status" -eq 5 ] && status=0
[ "$ray_status" -eq 5 ] && ray_status=0
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$ray_status"
