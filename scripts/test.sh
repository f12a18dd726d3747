#!/usr/bin/env bash
# The test suite (tiers, format, engine, multi-rank, CLI, DCP, faults).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TIERCHECK_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
