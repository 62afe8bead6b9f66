#!/usr/bin/env bash
# Build, on a machine with a package index, the wheels a GPU node needs to install megaflex offline
# on top of its own (preinstalled) torch, triton and numpy: DeepSpeed (built without ops: a
# py3-none-any wheel), hjson, pydantic and pydantic-core, sentencepiece, tokenizers, PyYAML, ...:
# the closure of megaflex's dependencies for the named target, minus torch, triton and numpy.
#
#   bash launch/wheelhouse.sh --python 3.12 --platform manylinux2014_x86_64 --out wheelhouse-py312
#   # copy the folder to the cluster, then on the node (no index needed):
#   MEGAFLEX_OFFLINE_WHEELS=wheelhouse-py312 bash launch/setup_env.sh
#
# Options: --python X.Y (default: this python's), --platform TAG (repeatable; default
# manylinux_2_28_x86_64 and manylinux2014_x86_64: torch >= 2.11 needs glibc >= 2.28 anyway),
# --out DIR (default wheelhouse-pyXY), --torch VERSION / --numpy VERSION (the node's, default
# 2.11.0 / 2.2.0: dependencies are resolved as if those were installed; neither is downloaded),
# --extra NAME (repeatable: megaflex[NAME] too, e.g. `--extra tensorboard`: 40.6 MB in all).
# By default only megaflex's core dependencies (pyproject.toml `dependencies`: what megaflex-train
# and `python -m benchmarks.gpu_check` import; 18.8 MiB for Python 3.12) and setuptools + wheel (for
# the editable install) are included; not the extras (`tensorboard`: without it a run warns and
# writes metrics.jsonl only; `tools`: datasets, matplotlib; `hf`, `wandb`, `gpu`).
# Prints the wheelhouse's size; exits non-zero if any wheel cannot be had for the target. The
# checkout is only read: megaflex's wheel is built from a temporary copy of it (a read-only checkout
# works, and no build/ or megaflex.egg-info is left in it). `--help`: this text.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
platforms=()
out=""
py_version=""
torch_version=2.11.0
numpy_version=2.2.0
extras=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python|--platform|--out|--torch|--numpy|--extra)
      if [ $# -lt 2 ] || [[ "$2" == --* ]]; then
        echo "error: launch/wheelhouse.sh: $1 needs a value (--help for usage)" >&2
        exit 2
      fi
      case "$1" in
        --python) py_version="$2" ;;
        --platform) platforms+=("$2") ;;
        --out) out="$2" ;;
        --torch) torch_version="$2" ;;
        --numpy) numpy_version="$2" ;;
        --extra) extras="${extras:+$extras,}$2" ;;
      esac
      shift 2 ;;
    *) echo "error: launch/wheelhouse.sh: unknown argument '$1' (--help for usage)" >&2; exit 2 ;;
  esac
done
if [ -z "$py_version" ]; then
  py_version="$("$python_bin" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
    || { echo "error: PYTHON=$python_bin does not run; name one with PYTHON= or give --python X.Y" >&2; exit 2; }
fi
[[ "$py_version" =~ ^3\.[0-9]+$ ]] || { echo "error: --python: expected 3.X, got '$py_version'" >&2; exit 2; }
[ ${#platforms[@]} -gt 0 ] || platforms=(manylinux_2_28_x86_64 manylinux2014_x86_64)
abi="cp${py_version/./}"
out="${out:-wheelhouse-py${py_version/./}}"
if compgen -G "$out/*" > /dev/null; then
  echo "error: --out $out is not empty (old wheels would stay beside the new); remove it or name another" >&2
  exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# pip's output, less the "Location ... is ignored" notices of an unreachable local index
pip() { "$python_bin" -m pip "$@" 2>&1 | { grep -v "is ignored" || true; }; return "${PIPESTATUS[0]}"; }
target=(--only-binary=:all: --python-version "$py_version" --implementation cp --abi "$abi")
for p in "${platforms[@]}"; do target+=(--platform "$p"); done

echo "[wheelhouse] megaflex's own wheel (for its dependency list only; the node installs the repository)"
# From a copy of the checkout's files (git's view when it is a git checkout: no .venv, build outputs or
# data), made writable: building in place would write build/ and megaflex.egg-info into the checkout.
mkdir -p "$work/src"
if git -C "$repo" rev-parse --git-dir > /dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ ! -e "$f" ] || printf '%s\0' "$f"   # a file deleted in the working tree is not copied
  done | tar --null -T - -cf -) | tar -C "$work/src" -xf -
else
  tar -C "$repo" --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.egg-info' -cf - . | tar -C "$work/src" -xf -
fi
chmod -R u+w "$work/src"
pip wheel -q --no-deps "$work/src" -w "$work/local"
# Stand-ins for what the node already has: empty wheels with a local version no index holds, so the
# resolver takes them (their versions satisfy every requirement on them) and downloads nothing real.
"$python_bin" - "$work/local" "torch==$torch_version+node" "numpy==$numpy_version+node" <<'EOF'
import sys, zipfile
from pathlib import Path
folder = Path(sys.argv[1])
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: megaflex\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
EOF
printf 'torch==%s+node\nnumpy==%s+node\n' "$torch_version" "$numpy_version" > "$work/provided.txt"

deepspeed_req="$("$python_bin" - "$work"/local/megaflex-*.whl <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
print(next(r for r in reqs if r.startswith("deepspeed")))
EOF
)"
echo "[wheelhouse] $deepspeed_req without ops (DS_BUILD_OPS=0: a py3-none-any wheel; a GPU node JIT-builds what it uses)"
# --no-cache-dir: pip's wheel cache does not key on DS_BUILD_OPS, a cached build could hold compiled ops
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-binary deepspeed --no-cache-dir "$deepspeed_req" -w "$work/local"

echo "[wheelhouse] megaflex${extras:+[$extras]}'s other dependencies for Python $py_version on ${platforms[*]}"
version="$(basename "$work"/local/megaflex-*.whl | cut -d- -f2)"
pip download -q -d "$out" "${target[@]}" --find-links "$work/local" -c "$work/provided.txt" \
  "megaflex${extras:+[$extras]}==$version" "setuptools>=68" wheel
rm -f "$out"/megaflex-*.whl "$out"/torch-*+node-*.whl "$out"/numpy-*+node-*.whl
count="$(ls "$out"/*.whl | wc -l)"
size="$(cat "$out"/*.whl | wc -c)"
echo "[wheelhouse] $out: $count wheels, $(awk -v b="$size" 'BEGIN { printf "%.1f MiB (%d bytes)", b / 1048576, b }') in all"
