"""Check the packages a GPU node brings for an offline install (launch/setup_env.sh with
MEGAFLEX_OFFLINE_WHEELS): torch >= 2.11, numpy, and triton >= 3.6 when installed (a CUDA torch wheel
pins its own; a CPU-only torch has none). These are never installed from the wheelhouse, so a
missing or too old one is named here, exit 2, instead of as pip's "no matching distribution".

    python launch/check_node_packages.py     # prints the versions found; exit 0, or 2 with the reason
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

# The lowest versions megaflex supports (README, "Installation"; pyproject.toml's torch>=2.11).
MINIMUM = {"torch": (2, 11), "triton": (3, 6), "numpy": (1, 24)}
REQUIRED = ("torch", "numpy")


def release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) from "2.11.0+cu128" / "3.6.0rc1": the leading numeric fields."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:3])


def problems(versions: dict[str, str | None]) -> list[str]:
    """What is missing or too old, one line each (empty when the node can take the wheelhouse)."""
    found = []
    for name, minimum in MINIMUM.items():
        version = versions.get(name)
        want = ".".join(map(str, minimum))
        if version is None:
            if name in REQUIRED:
                found.append(f"{name} is not installed in this Python ({sys.executable}); the offline install "
                             f"expects the node's own {name} >= {want} (the wheelhouse does not carry it): name the "
                             "Python that has it with PYTHON=, and a venv made without --system-site-packages "
                             "(MEGAFLEX_VENV) does not see it")  # fmt: skip
        elif release(version) < minimum:
            found.append(f"{name} {version} is older than the lowest supported {want}; use a Python with "
                         f"{name} >= {want} (PYTHON=/path/to/python)")  # fmt: skip
    return found


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def main() -> int:
    versions = {name: installed(name) for name in MINIMUM}
    found = problems(versions)
    for line in found:
        print(f"[setup] error: {line}", file=sys.stderr)
    if not found:
        print("[setup] node packages: " + ", ".join(f"{n} {v}" for n, v in versions.items() if v))
    return 2 if found else 0


if __name__ == "__main__":
    sys.exit(main())
