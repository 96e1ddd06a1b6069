#!/usr/bin/env bash
# Runs the whole test suite (installs what it needs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# torch's store server resolves every client's name for its logs; where DNS is
# unreachable that stalls it for the resolver timeout (5 s). Keep it short.
export RES_OPTIONS="${RES_OPTIONS:-timeout:1 attempts:1}"
.venv/bin/python -m ruff check inprocess tests benchmarks examples
# Two workers: the multi-rank tests mostly wait on timeouts, so they overlap well
# even on 2 cores. TEST_WORKERS=0 runs serially.
# loadgroup: the tests of one xdist_group (the Ray tests share one Ray cluster)
# run on one worker; the others are spread as usual.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
