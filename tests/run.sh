#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow multi-process tests included).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/launch/setup_env.sh"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MEGAFLEX_DATA="${MEGAFLEX_DATA:-$repo/../shared/data}"
exec python -m pytest -q --timeout=900 --durations=15 "$@"
