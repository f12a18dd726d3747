#!/usr/bin/env bash
# The test suite (tiers, format, engine, multi-rank, CLI, DCP, faults).
# Everything the tests, torchrun and torch write to a temporary directory goes to one
# directory of our own, removed afterwards: a run leaves nothing behind in /tmp.
# Tests run in two worker processes (pytest-xdist): many wait on subprocesses, fsync or
# loopback sockets, so two workers finish sooner even on two cores. TIERCHECK_TEST_WORKERS=0
# runs them in this process. Idle workers steal queued tests from a busy one (--dist
# worksteal), so a run does not end on one worker's queue of multi-process tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
scratch="$(mktemp -d "${TMPDIR:-/tmp}/tiercheck-tests.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch"
status=0
"${TIERCHECK_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider \
    -n "${TIERCHECK_TEST_WORKERS:-2}" --dist worksteal "$@" || status=$?
exit "$status"
