"""Check the packages a Python brings for megaflex (launch/setup_env.sh): torch >= 2.11, numpy, and
triton >= 3.6 -- required with a CUDA torch, whose kernels need it (its wheel pins one); a CPU-only
torch may have none. For an offline install (MEGAFLEX_OFFLINE_WHEELS) these are never installed from
the wheelhouse, so a missing or too old one is named here, exit 2, instead of as pip's "no matching
distribution".

    python launch/check_node_packages.py                   # prints the versions found; exit 0, or 2 with the reasons
    python launch/check_node_packages.py --own-setuptools  # also setuptools >= 70.1 (a wheelhouse without
                                                           # setuptools: this Python's builds megaflex)
    python launch/check_node_packages.py --probe           # may megaflex use this Python's torch? exit 1
                                                           # (silent) without torch; numpy not required
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys

# The lowest versions megaflex supports (README, "Installation"; pyproject.toml's torch>=2.11).
MINIMUM = {"torch": (2, 11), "triton": (3, 6), "numpy": (1, 24)}
# setuptools that builds an editable install without the `wheel` package (bdist_wheel moved into it)
OWN_SETUPTOOLS = (70, 1)


def release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) from "2.11.0+cu128" / "3.6.0rc1": the leading numeric fields."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:3])


def problems(versions: dict[str, str | None], torch_cuda: str | None = None, required: tuple[str, ...] = ("torch", "numpy"),
             minimum: dict[str, tuple[int, ...]] = MINIMUM) -> list[str]:  # fmt: skip
    """What is missing or too old, one line each (empty when megaflex can use this Python's packages).
    ``torch_cuda``: the CUDA version torch was built for (``torch.version.cuda``), None for a CPU build."""
    found = []
    for name, lowest in minimum.items():
        version = versions.get(name)
        want = ".".join(map(str, lowest))
        if version is None:
            if name == "setuptools" and name in required:
                found.append(f"setuptools >= {want} is not installed in this Python ({sys.executable}) and the wheelhouse "
                             "has no setuptools wheel to build megaflex's editable install with: add setuptools and wheel "
                             "to it (launch/wheelhouse.sh does)")  # fmt: skip
            elif name in required:
                found.append(f"{name} is not installed in this Python ({sys.executable}); megaflex uses the node's own "
                             f"{name} >= {want} (a wheelhouse does not carry it): name the Python that has it with "
                             "PYTHON= (the venv, conda env or system Python that holds it)")  # fmt: skip
            elif name == "triton" and torch_cuda:
                found.append(f"torch {versions['torch']} is a CUDA build (CUDA {torch_cuda}) but triton is not installed: "
                             f"megaflex's GPU kernels need triton >= {want} (the one that torch wheel pins; torch 2.11: "
                             "triton 3.6.0); install it, or use a Python that has it (PYTHON=/path/to/python)")  # fmt: skip
        elif release(version) < lowest:
            found.append(f"{name} {version} is older than the lowest supported {want}; use a Python with "
                         f"{name} >= {want} (PYTHON=/path/to/python)")  # fmt: skip
    return found


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cuda_of_torch() -> str | None:
    """torch.version.cuda of the installed torch (None: a CPU-only build)."""
    import torch

    return getattr(torch.version, "cuda", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="store_true", help="exit 1 without a word when torch is not installed")
    parser.add_argument("--own-setuptools", action="store_true", help=f"also require setuptools >= "
                        f"{'.'.join(map(str, OWN_SETUPTOOLS))}")  # fmt: skip
    args = parser.parse_args(argv)
    minimum, required = dict(MINIMUM), ("torch",) if args.probe else ("torch", "numpy")
    if args.own_setuptools:
        minimum["setuptools"] = OWN_SETUPTOOLS
        required += ("setuptools",)
    versions = {name: installed(name) for name in minimum}
    if args.probe and versions["torch"] is None:
        return 1
    torch_cuda = None
    if versions["torch"] is not None and release(versions["torch"]) >= MINIMUM["torch"]:
        try:
            torch_cuda = cuda_of_torch()
        except Exception as exc:  # a broken install: the one line says why
            versions_line = f"torch {versions['torch']} does not import ({type(exc).__name__}: {exc})"
            print(f"[setup] {'not using this torch' if args.probe else 'error'}: {versions_line}", file=sys.stderr)
            return 2
    found = problems(versions, torch_cuda, required, minimum)
    for line in found:
        print(f"[setup] {'not using this torch' if args.probe else 'error'}: {line}", file=sys.stderr)
    if not found:
        cuda = f" (CUDA {torch_cuda})" if torch_cuda else ""
        print("[setup] node packages: " + ", ".join(f"{n} {v}{cuda if n == 'torch' else ''}"
                                                    for n, v in versions.items() if v))  # fmt: skip
    return 2 if found else 0


if __name__ == "__main__":
    sys.exit(main())
