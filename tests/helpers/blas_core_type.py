"""Print an OpenBLAS core type other than the one this machine uses by default, and runnable here
(not a test module; tests/run.sh runs the numerics tests again under it).

numpy's OpenBLAS (which does the Triton interpreter's dot products) picks its kernels per CPU
family, and each family rounds differently; a tolerance tuned to one family fails on the others.
Forcing a kernel set the CPU cannot execute crashes (SkylakeX needs AVX-512, Haswell AVX2 + FMA),
so the choice follows /proc/cpuinfo: default AVX-512 kernels -> Haswell; AVX-512 CPU with other
default kernels -> SkylakeX; AVX2 + FMA -> Sandybridge (AVX, no FMA; Haswell if that is the
default already); older -> Nehalem.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def default_core() -> str | None:
    """The kernel set OpenBLAS picked (threadpoolctl reports it), or None when unknown."""
    try:
        importlib.import_module("numpy")  # loads numpy's OpenBLAS, so threadpoolctl sees it
        import threadpoolctl
    except ImportError:
        return None
    cores = [info.get("architecture") for info in threadpoolctl.threadpool_info() if info.get("internal_api") == "openblas"]
    return cores[0] if cores and cores[0] else None


def other_core(default: str | None, flags: set[str]) -> str:
    if "avx512f" in flags:
        # unknown default on an AVX-512 CPU: OpenBLAS normally picks its AVX-512 kernels there
        return "Haswell" if default is None or default.lower() in AVX512_CORES else "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell" if default is not None and default.lower() == "sandybridge" else "Sandybridge"
    return "Nehalem"


if __name__ == "__main__":
    sys.stdout.write(other_core(default_core(), cpu_flags()) + "\n")
