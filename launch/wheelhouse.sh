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
# and `python -m benchmarks.gpu_check` import; 19.8 MB for Python 3.12) and setuptools + wheel (for
# the editable install) are included; not the extras (`tensorboard`: without it a run warns and
# writes metrics.jsonl only; `tools`: datasets, matplotlib; `hf`, `wandb`, `gpu`).
# Prints the wheelhouse's size; exits non-zero if any wheel cannot be had for the target.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"
py_version="$("$python_bin" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
platforms=()
out=""
torch_version=2.11.0
numpy_version=2.2.0
extras=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py_version="$2"; shift 2 ;;
    --platform) platforms+=("$2"); shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --torch) torch_version="$2"; shift 2 ;;
    --numpy) numpy_version="$2"; shift 2 ;;
    --extra) extras="${extras:+$extras,}$2"; shift 2 ;;
    *) echo "error: launch/wheelhouse.sh: unknown argument '$1' (see the header of the script)" >&2; exit 2 ;;
  esac
done
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
pip wheel -q --no-deps "$repo" -w "$work/local"
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
size="$(du -sk "$out" | cut -f1)"
echo "[wheelhouse] $out: $count wheels, $(( (size + 512) / 1024 )) MB"
