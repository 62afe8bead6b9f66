#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow multi-process tests included), and the
# numerics tests (marker "numerics") a second time with other CPU kernels: another OpenBLAS core
# type (numpy's BLAS, hence the Triton interpreter; tests/helpers/blas_core_type.py) and ATen's portable
# (non-SIMD) kernels, which round differently, so that a tolerance tuned to one CPU family's
# rounding fails here too. MEGAFLEX_BLAS_SECOND_PASS=0 skips it; either pass failing fails the run.
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
run_pytest() {
  python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --timeout=300 --maxfail=5 "$@"
}
# The second pass runs alongside the first at a lower CPU priority (nice 10): the first pass leaves the
# CPUs ~13% idle (its ranks wait on each other and on I/O), which is about what the second needs;
# what it has not done by then it finishes at full speed. Its output follows the first pass's.
second_pid=""
if [ "${MEGAFLEX_BLAS_SECOND_PASS:-1}" != "0" ]; then
  core="$(python tests/helpers/blas_core_type.py)"
  second_dir="$(mktemp -d)"
  trap 'if [ -n "$second_pid" ]; then kill "$second_pid" 2>/dev/null || true; fi; rm -rf "$second_dir"' EXIT
  echo "[tests/run.sh] numerics tests a second time, alongside, with OPENBLAS_CORETYPE=$core ATEN_CPU_CAPABILITY=default"
  OPENBLAS_CORETYPE="$core" ATEN_CPU_CAPABILITY=default nice -n 10 python -m pytest -q -p no:cacheprovider \
    --basetemp "$second_dir/tmp" -n "${PYTEST_WORKERS:-2}" --dist loadfile --timeout=900 --maxfail=5 \
    -m numerics "$@" > "$second_dir/log" 2>&1 &
  second_pid=$!
fi
status=0
run_pytest --durations=15 "$@" || status=$?
if [ -n "$second_pid" ]; then
  second=0
  wait "$second_pid" || second=$?
  second_pid=""
  echo "[tests/run.sh] numerics tests with OPENBLAS_CORETYPE=$core ATEN_CPU_CAPABILITY=default (exit $second):"
  cat "$second_dir/log"
  # 5: no numerics test among the arguments given (e.g. one other file): nothing to re-run
  if [ "$second" -ne 0 ] && [ "$second" -ne 5 ]; then status=$second; fi
fi
exit "$status"
