#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow multi-process tests included).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/launch/setup_env.sh"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MEGAFLEX_DATA="${MEGAFLEX_DATA:-$repo/../shared/data}"
# A hung test fails after 300 s (the slowest takes ~22 s here) and 5 failures stop the run, so a
# systematic hang reports its traceback instead of running into the CI time limit.
# Two workers (one per core here), whole files per worker: a file's slow multi-process tests share
# module fixtures, and the suite takes about half the wall time of one worker.
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --timeout=300 --maxfail=5 --durations=15 "$@"
