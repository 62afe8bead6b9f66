#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow multi-process tests included), then the
# numerics tests (marker "numerics") a second time with other CPU kernels: another OpenBLAS core
# type (numpy's BLAS, hence the Triton interpreter; tests/blas_core_type.py) and ATen's portable
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
status=0
run_pytest --durations=15 "$@" || status=$?
if [ "${MEGAFLEX_BLAS_SECOND_PASS:-1}" != "0" ]; then
  core="$(python tests/blas_core_type.py)"
  echo "[tests/run.sh] numerics tests again with OPENBLAS_CORETYPE=$core ATEN_CPU_CAPABILITY=default"
  second=0
  OPENBLAS_CORETYPE="$core" ATEN_CPU_CAPABILITY=default run_pytest -m numerics "$@" || second=$?
  # 5: no numerics test among the arguments given (e.g. one other file): nothing to re-run
  if [ "$second" -ne 0 ] && [ "$second" -ne 5 ]; then status=$second; fi
fi
exit "$status"
