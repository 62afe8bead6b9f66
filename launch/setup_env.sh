#!/usr/bin/env bash
# Create (or reuse) the project virtual environment at .venv and install megaflex into it.
# torch is installed first and pinned, so no other package can pull a different (multi-GB) build.
# Idempotent: re-running with an unchanged pyproject.toml installs nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAFLEX_VENV:-$repo/.venv}"
torch_spec="${MEGAFLEX_TORCH:-torch==2.13.0}"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment at $venv"
  "$python_bin" -m venv "$venv"
fi
stamp="$venv/.megaflex-installed"
want="$(cat "$repo/pyproject.toml" | sha256sum | cut -c1-16) $torch_spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] environment up to date ($venv)"
else
  echo "[setup] installing $torch_spec"
  # MEGAFLEX_TORCH_INDEX: a wheel index for torch alone (e.g. PyTorch's CPU-only index on a machine
  # without a GPU, where PyPI's default Linux wheel is the CUDA build).
  "$venv/bin/pip" install -q ${MEGAFLEX_TORCH_INDEX:+--index-url "$MEGAFLEX_TORCH_INDEX"} "$torch_spec" 2>&1 \
    | grep -v "is ignored" || true
  "$venv/bin/python" -c "import torch" || { echo "[setup] torch failed to install" >&2; exit 1; }
  echo "[setup] installing megaflex and its dependencies"
  "$venv/bin/pip" install -q -e "$repo[dev]" "$torch_spec" 2>&1 | grep -v "is ignored" || true
  "$venv/bin/python" -c "import megaflex, deepspeed, sentencepiece, datasets" \
    || { echo "[setup] dependency install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# JIT-built DeepSpeed ops are kept between runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/.torch_extensions}"
export PATH="$venv/bin:$PATH"
# PyTorch's CPU allocator does not cache: with glibc defaults every tensor over 32 MiB is a fresh
# mmap that page-faults on every step. Keeping freed memory in the heap halves long-sequence CPU
# step times (measured in evaluation/bench_attention.py); harmless on GPU runs.
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
