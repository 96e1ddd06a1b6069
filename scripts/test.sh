#!/usr/bin/env bash
# Runs the whole test suite (installs what it needs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m ruff check inprocess tests benchmarks examples
exec .venv/bin/python -m pytest "$@"
