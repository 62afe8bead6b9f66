"""The ``environment`` stage: what the run stands on, before anything is measured: versions,
``pip check``, the NVIDIA driver (nvidia-smi), whether torch can use CUDA (and why not), and which
triton is imported (path and version: a CUDA torch wheel brings its own pinned triton)."""

from __future__ import annotations

import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
from typing import Any

from benchmarks.gpu_check.common import REPO, Stage


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _command(cmd: list[str], timeout: float = 60) -> dict[str, Any]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": repr(err)[:300]}
    return {"returncode": proc.returncode, "output": (proc.stdout + proc.stderr).strip()[-3000:]}


def environment(stage: Stage) -> dict[str, Any]:
    import torch

    from megaflex.parallel.launcher_env import cuda_unusable_reason

    result: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {d: _version(d) for d in ("torch", "triton", "deepspeed", "flash-linear-attention", "fla-core",
                                               "numpy", "transformers", "megaflex")},  # fmt: skip
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_unusable_reason": cuda_unusable_reason(),
        "git_commit": _command(["git", "rev-parse", "HEAD"]).get("output"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count(),
                         "memory_gib": round(props.total_memory / 2**30, 1), "cudnn": torch.backends.cudnn.version(),
                         "nccl": ".".join(map(str, torch.cuda.nccl.version()))}  # fmt: skip
    try:
        import triton

        result["triton_imported"] = {"version": triton.__version__, "path": triton.__file__}
    except ImportError as err:
        result["triton_imported"] = {"error": repr(err)}
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,compute_cap"
        result["nvidia_smi"] = _command(["nvidia-smi", query, "--format=csv,noheader"])
    else:
        result["nvidia_smi"] = {"status": "nvidia-smi not on PATH"}  # informational: CUDA's usability is checked above
    check = _command([sys.executable, "-m", "pip", "check"], timeout=120)
    ours = ours_broken(check.get("output", "")) if check.get("returncode") else []
    # a lent image holds hundreds of packages: a conflict between two of them that megaflex never
    # imports is recorded, not a failure of this run
    result["pip_check"] = {**check, "passed": "error" not in check and not ours, "megaflex_related": ours}
    return result


# what megaflex and gpu_check import, and what the carried wheels bring
_OURS = {"torch", "triton", "numpy", "deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types",
         "typing-inspection", "typing-extensions", "sentencepiece", "tokenizers", "pyyaml", "tqdm", "safetensors",
         "flash-linear-attention", "fla-core", "megaflex", "msgpack", "ninja", "psutil", "py-cpuinfo", "einops"}  # fmt: skip


def ours_broken(pip_check_output: str) -> list[str]:
    """The lines of ``pip check`` that name a package megaflex depends on (as the broken one or
    the missing/conflicting requirement)."""
    def norm(name: str) -> str:
        return name.lower().replace("_", "-").strip(",.")

    return [line for line in pip_check_output.splitlines() if any(norm(w) in _OURS for w in line.split())]
