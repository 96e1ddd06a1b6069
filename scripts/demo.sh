#!/usr/bin/env bash
# Runs the demo (installs what it needs first): a 2 nodes x 2 workers training
# job under inprocess-run, with injected faults, and a summary at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python examples/demo.py "$@"
