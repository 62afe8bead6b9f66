#!/usr/bin/env bash
# Create (or reuse) the project virtual environment at .venv and install megaflex into it.
# torch is installed first and pinned, so no other package can pull a different (multi-GB) build.
# Idempotent: re-running with an unchanged pyproject.toml, torch and mode installs nothing.
#
#   source launch/setup_env.sh                  # CPU / CI: torch + megaflex[dev] (triton pinned for
#                                               # the interpreter tests)
#   MEGAFLEX_GPU=1 MEGAFLEX_TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     bash launch/setup_env.sh                  # GPU node: CUDA torch from that index + megaflex[gpu]
#   MEGAFLEX_OFFLINE_WHEELS=wheelhouse-py312 bash launch/setup_env.sh   # GPU node without an index
#                                               # (or: bash launch/setup_env.sh --offline DIR)
#
# GPU mode (MEGAFLEX_GPU=1, or `--gpu` when run as a script): torch from MEGAFLEX_TORCH_INDEX (default
# PyPI, whose Linux wheel is a CUDA build), which must be a CUDA build; then `.[gpu]`, which pins no
# triton, so the triton that torch's wheel pins (torch 2.13.0: triton==3.7.1) is the one installed.
# Offline mode (MEGAFLEX_OFFLINE_WHEELS=DIR): for a node whose Python already has torch (>= 2.11),
# its triton (>= 3.6) and numpy, and no package index. A new venv is made with --system-site-packages
# (PYTHON: that Python, default python3), so it sees them and they stay untouched (no torch pin);
# MEGAFLEX_VENV may also name the node's own venv or conda env, which is then installed into.
# megaflex and its core dependencies come from DIR, a wheelhouse built elsewhere for this Python by
# launch/wheelhouse.sh, with `pip --no-index --find-links DIR`.
# A mode sticks to the venv: later `source launch/setup_env.sh` (train.sh, sbatch) keep it (offline:
# with the same DIR, never an index).
# A failed install stops with pip's own error above the "[setup]" line, never hidden.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAFLEX_VENV:-$repo/.venv}"
torch_spec="${MEGAFLEX_TORCH:-torch==2.13.0}"
python_bin="${PYTHON:-python3}"
stamp="$venv/.megaflex-installed"
gpu_mode="${MEGAFLEX_GPU:-}"
offline="${MEGAFLEX_OFFLINE_WHEELS:-}"
# `--gpu` / `--offline DIR` only when executed: a sourcing script's own arguments are not ours.
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--gpu" ]; then gpu_mode=1; fi
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--offline" ]; then offline="${2:-}"; fi
if [ -z "$offline" ] && [ -z "$gpu_mode" ] && [ -f "$stamp" ] && [[ "$(cat "$stamp")" == *" offline:"* ]]; then
  offline="$(cat "$stamp")"; offline="${offline#* offline:}"   # an offline venv stays offline
fi
if [ -n "$offline" ]; then
  [ ! -d "$offline" ] || offline="$(cd "$offline" && pwd)"
  gpu_mode=0
fi
if [ -z "$gpu_mode" ]; then
  # Unset: the mode this venv was installed in, so that launch/train.sh sourcing this script on a
  # GPU node keeps the GPU install (MEGAFLEX_GPU=0 switches back to the CPU/test install).
  gpu_mode=0
  if [ -f "$stamp" ] && [[ "$(cat "$stamp")" == *" gpu" ]]; then gpu_mode=1; fi
fi
extra=dev
[ "$gpu_mode" = 1 ] && extra=gpu

# pip with its output shown; only the "Location ... is ignored" notices of an unreachable local
# index are dropped. The exit status is pip's: a failed resolution stops here, its error visible.
_megaflex_pip_install() {
  if "$venv/bin/pip" install -q "$@" 2>&1 | { grep -v "is ignored" || true; }; then
    return 0
  fi
  echo "[setup] pip install $* failed: pip's error is above" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment at $venv${offline:+ (it sees the torch, triton and numpy of $python_bin)}"
  "$python_bin" -m venv ${offline:+--system-site-packages} "$venv"
fi
want="$(cat "$repo/pyproject.toml" | sha256sum | cut -c1-16) $torch_spec"
[ "$gpu_mode" = 1 ] && want="$want gpu"
[ -n "$offline" ] && want="${want% *} offline:$offline"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] environment up to date ($venv)"
elif [ -n "$offline" ]; then
  compgen -G "$offline/*.whl" > /dev/null || {
    echo "[setup] MEGAFLEX_OFFLINE_WHEELS=$offline: no wheels there; build them with launch/wheelhouse.sh" \
      "on a machine with a package index and copy the folder here" >&2
    exit 2
  }
  # The node's torch, triton and numpy stay as they are: check them, never install them.
  "$venv/bin/python" "$repo/launch/check_node_packages.py" || exit 2
  echo "[setup] installing megaflex and its dependencies from $offline (no index)"
  _megaflex_pip_install --no-index --find-links "$offline" -e "$repo"
  "$venv/bin/python" -c "import megaflex, deepspeed, sentencepiece, tokenizers, yaml" \
    || { echo "[setup] megaflex's dependencies do not import (error above)" >&2; exit 1; }
  echo "$want" > "$stamp"
else
  echo "[setup] installing $torch_spec${MEGAFLEX_TORCH_INDEX:+ from $MEGAFLEX_TORCH_INDEX}"
  # MEGAFLEX_TORCH_INDEX: a wheel index for torch alone (a CUDA build's index on a GPU node; PyTorch's
  # CPU-only index on a machine without a GPU, where PyPI's default Linux wheel is the CUDA build).
  _megaflex_pip_install ${MEGAFLEX_TORCH_INDEX:+--index-url "$MEGAFLEX_TORCH_INDEX"} "$torch_spec"
  if [ "$gpu_mode" = 1 ]; then
    # Exit 3: imported, but a CPU-only build (what a CPU index or a local wheel cache gives).
    "$venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 3)' && status=0 || status=$?
    if [ "$status" -eq 3 ]; then
      echo "[setup] GPU mode: the installed torch is a CPU-only build; name a CUDA wheel index with" \
        "MEGAFLEX_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu128)" >&2
      exit 1
    fi
    [ "$status" -eq 0 ] || { echo "[setup] torch failed to import (error above)" >&2; exit 1; }
  else
    "$venv/bin/python" -c "import torch" || { echo "[setup] torch failed to import (error above)" >&2; exit 1; }
  fi
  echo "[setup] installing megaflex[$extra] and its dependencies"
  _megaflex_pip_install -e "$repo[$extra]" "$torch_spec"
  "$venv/bin/python" -c "import megaflex, deepspeed, sentencepiece, tokenizers, datasets" \
    || { echo "[setup] megaflex's dependencies do not import (error above)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# JIT-built DeepSpeed ops are kept between runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/.torch_extensions}"
export PATH="$venv/bin:$PATH"
# PyTorch's CPU allocator does not cache: with glibc defaults every tensor over 32 MiB is a fresh
# mmap that page-faults on every step. Keeping freed memory in the heap halves long-sequence CPU
# step times (measured in benchmarks/attention.py). Not on GPU nodes: there the host holds
# pinned buffers and loader workers, and a heap that never returns memory only grows.
if [ "$gpu_mode" != 1 ] && ! compgen -G "/dev/nvidia[0-9]*" > /dev/null; then
  export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
fi
