#!/usr/bin/env bash
# Install megaflex into a virtual environment (default .venv) and put it first on PATH.
# Idempotent: re-running with an unchanged pyproject.toml, torch and mode installs nothing.
#
#   source launch/setup_env.sh                  # CPU / CI: torch + megaflex[dev] (triton pinned for
#                                               # the interpreter tests)
#   MEGAFLEX_GPU=1 MEGAFLEX_TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     bash launch/setup_env.sh                  # GPU node: CUDA torch from that index + megaflex[gpu]
#   MEGAFLEX_OFFLINE_WHEELS=wheelhouse-py312 bash launch/setup_env.sh   # GPU node without an index
#                                               # (or: bash launch/setup_env.sh --offline DIR)
#
# Which environment (one "[setup]" line says which was chosen), when the venv does not exist yet:
# - PYTHON (default python3: the venv, conda env or system Python the caller is in) already holds a
#   suitable torch (>= 2.11; a CUDA build with its triton >= 3.6; launch/check_node_packages.py):
#   .venv is a layer on top of that environment. It is made from that Python without pip and a .pth
#   file adds the environment's site-packages (with their own .pth files) after the layer's own, so
#   its torch, triton, numpy and pip are seen and used but never changed: pip (the layer's `pip`
#   runs that pip with the layer's Python) installs megaflex and what is missing into the layer
#   only, and refuses to touch files outside it. This works for a read-only environment, a system
#   Python pip may not write to, and a Python that is itself a venv (a venv made with
#   --system-site-packages from a venv sees the *base* interpreter's packages, not the parent's).
# - otherwise: a fresh .venv with torch==2.13.0 (MEGAFLEX_TORCH) installed first and pinned, so no
#   other package can pull a different (multi-GB) build.
# MEGAFLEX_VENV naming an existing environment (the node's own venv or conda env) installs into it.
#
# GPU mode (MEGAFLEX_GPU=1, or `--gpu` when run as a script): torch from MEGAFLEX_TORCH_INDEX (default
# PyPI, whose Linux wheel is a CUDA build), which must be a CUDA build; then `.[gpu]`, which pins no
# triton, so the triton that torch's wheel pins (torch 2.13.0: triton==3.7.1) is the one installed.
# A layer on a CUDA torch installs `.[gpu]` too, with the torch pinned to the one it has.
# Offline mode (MEGAFLEX_OFFLINE_WHEELS=DIR): for a node whose Python already has torch (>= 2.11),
# its triton (>= 3.6) and numpy, and no package index: always the layer (or MEGAFLEX_VENV's env).
# megaflex and its core dependencies come from DIR, a wheelhouse built elsewhere for this Python by
# launch/wheelhouse.sh (or only the wheels the node lacks), with `pip --no-index --find-links DIR`;
# a DIR without setuptools builds the editable install with the environment's own setuptools.
# A mode sticks to the venv: later `source launch/setup_env.sh` (train.sh, sbatch) keep it (offline:
# with the same DIR, never an index).
# A failed install stops with pip's own error above the "[setup]" line, never hidden, and removes a
# venv this attempt made; a venv it made that has no finished install, or was made from another
# Python than the PYTHON named now, is made again.
#
# Sourced, it leaves the caller's shell options (set -e/-u/-o pipefail) as they were and returns its
# status (0, 1 install failed, 2 bad input); it never exits the caller's shell.

# pip install with its output shown; only the "Location ... is ignored" notices of an unreachable
# local index are dropped. The status is pip's: a failed resolution stops here, its error visible.
_megaflex_pip_install() {
  "$venv/bin/pip" install -q "$@" 2>&1 | { grep -v "is ignored" || true; }
  [ "${PIPESTATUS[0]}" -eq 0 ] && return 0
  echo "[setup] pip install $* failed: pip's error is above" >&2
  return 1
}

# The interpreter behind a Python command, or nothing when it does not run: bin/pythonX.Y of its
# environment (python, python3 and a symbolic link to a venv's python name the same one; resolving
# links would name the base interpreter instead of the venv).
_megaflex_interpreter() {
  "$1" -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "python%d.%d" % sys.version_info[:2]))' 2>/dev/null
}

# Make $venv a layer on the environment of $python_bin (see the header).
_megaflex_make_layer() {
  local without_pip=--without-pip purelib name
  "$python_bin" -c "import pip" 2>/dev/null || without_pip=""   # no pip to borrow: the layer gets its own
  "$python_bin" -m venv $without_pip "$venv" || return 1
  if [ -n "$without_pip" ]; then
    # `pip` on PATH installs into the layer, as `python -m pip` does: the parent's pip, the layer's Python
    for name in pip pip3; do
      printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n' > "$venv/bin/$name" && chmod +x "$venv/bin/$name" || return 1
    done
  fi
  purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || return 1
  "$python_bin" - "$purelib/_megaflex_parent_env.pth" <<'EOF' || return 1
import os, site, sys
# What that Python imports from, in its order: the user site (when enabled), then its site-packages.
# addsitedir, not a bare path, so that their own .pth files (editable installs, namespace packages)
# are processed as they are there.
dirs = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
dirs = [d for d in dirs + site.getsitepackages() if os.path.isdir(d)]
with open(sys.argv[1], "w") as pth:
    pth.write("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
EOF
}

_megaflex_setup() {
  local repo venv torch_spec python_bin stamp made gpu_mode offline extra want kind="" interpreter status
  local created="" isolation=()
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${MEGAFLEX_VENV:-$repo/.venv}"
  torch_spec="${MEGAFLEX_TORCH:-torch==2.13.0}"
  python_bin="${PYTHON:-python3}"
  stamp="$venv/.megaflex-installed"
  made="$venv/.megaflex-made-from"   # "layer|fresh <interpreter>": a venv this script made
  gpu_mode="${MEGAFLEX_GPU:-}"
  offline="${MEGAFLEX_OFFLINE_WHEELS:-}"
  # `--gpu` / `--offline DIR` only when executed: a sourcing script's own arguments are not ours.
  if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--gpu" ]; then gpu_mode=1; fi
  if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--offline" ]; then offline="${2:-}"; fi

  if [ -z "$offline" ] && [ -z "$gpu_mode" ] && [ -f "$stamp" ] && [[ "$(cat "$stamp")" == *" offline:"* ]]; then
    offline="$(cat "$stamp")"; offline="${offline#* offline:}"   # an offline venv stays offline
  fi
  # A venv this script made is trusted only with a finished install, and only for the Python it was
  # made from: one left by a failed or interrupted attempt, or made from another Python than the
  # PYTHON named now (what an error message recommends), is made again.
  if [ -f "$made" ]; then
    local reason="" from
    from="$(cut -d' ' -f2- < "$made")"
    if [ ! -f "$stamp" ]; then
      reason="an earlier attempt did not finish installing into it"
    elif [ -n "${PYTHON:-}" ] && [ "$(_megaflex_interpreter "$PYTHON")" != "$from" ]; then
      reason="it was made from $from, PYTHON=$PYTHON"
    fi
    if [ -n "$reason" ]; then
      echo "[setup] making $venv again: $reason"
      rm -rf "$venv"
    fi
  fi

  if [ -n "$offline" ]; then
    [ ! -d "$offline" ] || offline="$(cd "$offline" && pwd)"
    gpu_mode=0
    if ! compgen -G "$offline/*.whl" > /dev/null; then
      echo "[setup] MEGAFLEX_OFFLINE_WHEELS=$offline: no wheels there; build them with launch/wheelhouse.sh" \
        "on a machine with a package index and copy the folder here" >&2
      return 2
    fi
    # Without setuptools in DIR (e.g. only the wheels the node lacks), the environment's own builds
    # the editable install.
    compgen -G "$offline/setuptools-*.whl" > /dev/null || isolation=(--no-build-isolation)
  fi
  # Unset: the mode this venv was installed in, so that launch/train.sh sourcing this script on a
  # GPU node keeps the GPU install (MEGAFLEX_GPU=0 switches back to the CPU/test install).
  if [ -z "$gpu_mode" ] && [ -f "$stamp" ]; then
    gpu_mode=0
    [[ "$(cat "$stamp")" != *" gpu" ]] || gpu_mode=1
  fi

  [ ! -f "$made" ] || kind="$(cut -d' ' -f1 < "$made")"
  if [ ! -x "$venv/bin/python" ]; then
    if [ -e "$venv" ] && [ -n "$(ls -A "$venv")" ]; then
      echo "[setup] $venv exists and is not a virtual environment; name another with MEGAFLEX_VENV" >&2
      return 2
    fi
    interpreter="$(_megaflex_interpreter "$python_bin")"
    if [ -z "$interpreter" ]; then
      echo "[setup] PYTHON=$python_bin does not run; name a Python 3.10+ with PYTHON=" >&2
      return 2
    fi
    # Exit 0: a suitable torch (its versions printed), 1: no torch, 2: an unsuitable one (why printed).
    # Offline there is no index to install torch from: anything but 0 stops here, before anything is made.
    status=0
    if [ -n "$offline" ]; then
      "$python_bin" "$repo/launch/check_node_packages.py" ${isolation:+--own-setuptools} || return 2
    else
      "$python_bin" "$repo/launch/check_node_packages.py" --probe || status=$?
    fi
    if [ "$status" -eq 0 ]; then
      kind=layer
      echo "[setup] using the environment of $interpreter: megaflex goes into $venv, a layer on top" \
        "of it that sees its packages and leaves them untouched"
      _megaflex_make_layer || { rm -rf "$venv"; echo "[setup] making the layer $venv failed (error above)" >&2; return 1; }
    else
      kind=fresh
      local why="no torch"
      [ "$status" -eq 1 ] || why="no suitable torch (above)"
      echo "[setup] $interpreter has $why: creating a fresh virtual environment at $venv with $torch_spec"
      "$python_bin" -m venv "$venv" || { rm -rf "$venv"; echo "[setup] creating $venv failed (error above)" >&2; return 1; }
    fi
    echo "$kind $interpreter" > "$made"
    created=1
  fi
  if [ "$kind" = layer ]; then
    # The parent's torch stays: pinned, so that no dependency pulls another build into the layer.
    torch_spec="torch==$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')" || return 1
    if [ -z "$gpu_mode" ]; then  # first install: a CUDA torch pins its own triton, so the gpu extra
      gpu_mode=0
      "$venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null && gpu_mode=1
    fi
  fi
  [ -n "$gpu_mode" ] || gpu_mode=0
  extra=dev
  [ "$gpu_mode" = 1 ] && extra=gpu

  want="$(sha256sum < "$repo/pyproject.toml" | cut -c1-16) $torch_spec"
  [ "$gpu_mode" = 1 ] && want="$want gpu"
  [ -n "$offline" ] && want="${want% *} offline:$offline"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup] environment up to date ($venv${kind:+, $(cat "$made")})"
  else
    _megaflex_install || {
      status=$?
      # Nothing a retry would trust: the venv this attempt made goes (one MEGAFLEX_VENV named stays).
      if [ -n "$created" ]; then rm -rf "$venv"; fi
      return "$status"
    }
    echo "$want" > "$stamp"   # only after a finished install
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
}

# The install itself, into an existing venv: 0, 1 (failed: the error is above) or 2 (the node's own
# packages do not fit).
_megaflex_install() {
  if [ -n "$offline" ]; then
    # The node's torch, triton and numpy stay as they are: check them (already done for a venv made
    # just now from that Python), never install them.
    if [ -z "$created" ]; then
      "$venv/bin/python" "$repo/launch/check_node_packages.py" ${isolation:+--own-setuptools} || return 2
    fi
    echo "[setup] installing megaflex and its dependencies from $offline (no index)"
    _megaflex_pip_install --no-index --find-links "$offline" "${isolation[@]}" -e "$repo" || return 1
    "$venv/bin/python" -c "import megaflex, deepspeed, sentencepiece, tokenizers, yaml" \
      || { echo "[setup] megaflex's dependencies do not import (error above)" >&2; return 1; }
    return 0
  fi
  if [ "$kind" != layer ]; then
    echo "[setup] installing $torch_spec${MEGAFLEX_TORCH_INDEX:+ from $MEGAFLEX_TORCH_INDEX}"
    # MEGAFLEX_TORCH_INDEX: a wheel index for torch alone (a CUDA build's index on a GPU node; PyTorch's
    # CPU-only index on a machine without a GPU, where PyPI's default Linux wheel is the CUDA build).
    _megaflex_pip_install ${MEGAFLEX_TORCH_INDEX:+--index-url "$MEGAFLEX_TORCH_INDEX"} "$torch_spec" || return 1
  fi
  if [ "$gpu_mode" = 1 ]; then
    # Exit 3: imported, but a CPU-only build (what a CPU index or a local wheel cache gives).
    local cuda=0
    "$venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 3)' || cuda=$?
    if [ "$cuda" -eq 3 ]; then
      echo "[setup] GPU mode: the installed torch is a CPU-only build; name a CUDA wheel index with" \
        "MEGAFLEX_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu128)" >&2
      return 1
    fi
    [ "$cuda" -eq 0 ] || { echo "[setup] torch failed to import (error above)" >&2; return 1; }
  else
    "$venv/bin/python" -c "import torch" || { echo "[setup] torch failed to import (error above)" >&2; return 1; }
  fi
  echo "[setup] installing megaflex[$extra] and its dependencies"
  _megaflex_pip_install -e "$repo[$extra]" "$torch_spec" || return 1
  "$venv/bin/python" -c "import megaflex, deepspeed, sentencepiece, tokenizers, datasets" \
    || { echo "[setup] megaflex's dependencies do not import (error above)" >&2; return 1; }
}

if _megaflex_setup "$@"; then _megaflex_status=0; else _megaflex_status=$?; fi
unset -f _megaflex_setup _megaflex_install _megaflex_make_layer _megaflex_interpreter _megaflex_pip_install
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  eval "unset _megaflex_status; return $_megaflex_status"
fi
exit "$_megaflex_status"
