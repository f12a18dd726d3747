#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install tiercheck into it.
# torch is pinned to 2.13.0 and installed before the project, so that pip never pulls a
# CUDA build; a torch already present in the environment is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TIERCHECK_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[dev]"
