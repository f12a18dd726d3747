#!/usr/bin/env bash
# The main job: train a small GPT on the CPU with a checkpoint every step, crash it with
# SIGKILL, restore from the fastest tier, and prove the result is bit-identical.
# torch makes a cache directory in /tmp the first time an optimizer is built: it goes to a
# directory of ours, removed afterwards, so the demo leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
scratch="$(mktemp -d "${TMPDIR:-/tmp}/tiercheck-demo-cache.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$scratch/torchinductor}"
"${TIERCHECK_VENV:-.venv}/bin/python" -m tiercheck.cli.demo "$@"
