#!/usr/bin/env bash
# The lent GPU's whole call in one command: install the carried wheels (no index), check the node's
# packages, run gpu_check with its report and stage logs in OUT, exit with gpu_check's status.
#
#   bash benchmarks/gpu_check/on_device.sh WHEELS OUT [--dry-run] [gpu_check flags ...]
#
# WHEELS: a folder of wheels for the node's Python (what the image lacks; docs/design.md#gpu lists
# them), installed with `pip --no-index --no-deps --target` into a folder put on PYTHONPATH, so the
# node's own environment (a venv holding torch and triton) is used as it is and never changed.
# OUT: what comes back from the machine: gpu_check.json, on_device.log (this script's console) and
# stage_logs.tar.gz (every stage's and trainer's log and metrics.jsonl). The work folder with the
# 247M checkpoints stays outside OUT (MEGAFLEX_GPU_CHECK_WORK, default a temporary folder): gigabytes
# that no caller wants back. --dry-run: the same steps on CPU (Triton's interpreter, tiny shapes),
# for testing this script where there is no GPU. Other flags go to `python -m benchmarks.gpu_check`
# (default --deadline 480).
# Exit status: gpu_check's (0 passed, 1 failed, 3 incomplete: a stage not run for time, 2 no usable
# GPU), or 4 when the wheels do not install, 5 when the node's packages do not fit.
set -uo pipefail
if [ $# -lt 2 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && { [ "$1" = "--help" ] || [ "$1" = "-h" ]; } && exit 0
  exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheels="$1"; out="$2"; shift 2
[ -d "$wheels" ] || { echo "on_device.sh: WHEELS $wheels: no such folder" >&2; exit 2; }
mkdir -p "$out" || { echo "on_device.sh: OUT $out: cannot create it" >&2; exit 2; }
wheels="$(cd "$wheels" && pwd)"; out="$(cd "$out" && pwd)"
python_bin="${PYTHON:-python3}"
site="${MEGAFLEX_DEVICE_SITE:-$(mktemp -d /tmp/megaflex-site.XXXXXX)}"
work="${MEGAFLEX_GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check_work.XXXXXX)}"
exec > >(tee "$out/on_device.log") 2>&1
stamp() { echo "[on_device $(date +%H:%M:%S)] $*"; }
stamp "python: $("$python_bin" -c 'import sys; print(sys.executable, sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "")')"

bundle_logs() {  # every log of the run, in one file (the call returns at most 8 files)
  (cd "$work" && find . \( -name '*.log' -o -name 'metrics.jsonl' -o -name '*.result.json' \) -print0 |
    tar -czf "$out/stage_logs.tar.gz" --null -T -) 2>/dev/null || true
}

stamp "installing $(ls "$wheels"/*.whl 2>/dev/null | wc -l) wheels from $wheels into $site (no index)"
if compgen -G "$wheels/*.whl" > /dev/null; then
  "$python_bin" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || { stamp "error: the wheels did not install (pip's error above)"; exit 4; }
fi
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$python_bin" "$repo/launch/check_node_packages.py" || { stamp "error: the node's packages do not fit (above)"; exit 5; }
"$python_bin" -c "import megaflex, deepspeed, yaml, sentencepiece; print('[on_device] imports: megaflex, deepspeed', deepspeed.__version__)" \
  || { stamp "error: megaflex's dependencies do not import (error above; carry the missing wheels)"; exit 4; }
"$python_bin" -m pip check 2>&1 | sed 's/^/[pip check] /' || true

stamp "gpu_check (work folder $work)"
cd "$repo"
"$python_bin" -m benchmarks.gpu_check --out "$out" --work-dir "$work" "$@"
status=$?
bundle_logs
stamp "gpu_check exit status $status; in $out: $(cd "$out" && ls | tr '\n' ' ')"
exit "$status"
