#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs the
# package with its test extra. torch is pinned to the CPU build that this
# machine serves locally; an unpinned torch would pull several GB of CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.inprocess-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "bootstrap: installing into .venv (log: .venv/install.log)"
    {
        .venv/bin/python -m pip install --upgrade pip || true
        .venv/bin/python -m pip install "torch==${TORCH_VERSION:-2.13.0}"
        # the ray extra for the Ray backend's tests, the plot extra for the report's
        # timeline (the core package needs neither)
        .venv/bin/python -m pip install -e ".[test,ray,plot]"
    } >.venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
    touch "$stamp"
fi
