#!/usr/bin/env bash
# The main job: train a small GPT on the CPU with a checkpoint every step, crash it with
# SIGKILL, restore from the fastest tier, and prove the result is bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TIERCHECK_VENV:-.venv}/bin/python" -m tiercheck.demo "$@"
