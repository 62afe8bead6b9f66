"""argparse types shared by every entry point: a value that cannot work is refused while the
arguments are parsed (one line, exit 2), before any data is read or any process group exists; and
``scratch_results``, the benchmarks' and studies' default output folder (never a committed one).

Imports nothing of megaflex, so every floor may use it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer >= 1 (0 is an error, not "use the default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. ``512,1024`` (at least one)."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    """A finite number (``nan`` and ``inf`` are refused: a limit set to them is never enforced)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def unit_interval(text: str) -> float:
    """A finite number in [0, 1]."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


# The path types return absolute paths: a relative one is taken from the directory the command
# was started in, once, here, so a subprocess run elsewhere (e.g. ``cwd=REPO``) means the same file.


def writable_file(text: str) -> Path:
    """An output file path whose folder exists or can be created, and that is not a directory.
    Checked (the folder is created) while parsing, so a finished run is never lost to its path."""
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file path")
    _ensure_dir(path.parent, text)
    return path


def writable_dir(text: str) -> Path:
    """An output directory that exists or can be created (it is created now), and is writable."""
    path = creatable_dir(text)
    _ensure_dir(path, text)
    return path


def creatable_dir(text: str) -> Path:
    """An output directory that exists, or that its nearest existing parent lets this user create;
    nothing is created now (for commands that make their folders only once they have work to put there)."""
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
    parent = next(d for d in (path, *path.parents) if d.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "is not a directory" if not parent.is_dir() else "is not writable"
        raise argparse.ArgumentTypeError(f"{text}: cannot be created here ({parent} {what})")
    return path


def existing_file(text: str) -> Path:
    """An input file that exists (resolved against the current directory)."""
    path = Path(text).expanduser().absolute()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file (from {os.getcwd()})")
    return path


def existing_dir(text: str) -> Path:
    """An input directory that exists (resolved against the current directory)."""
    path = Path(text).expanduser().absolute()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory (from {os.getcwd()})")
    return path


def available_device(text: str) -> str:
    """A torch device this machine has: ``cpu``, or ``cuda`` / ``cuda:N`` with a usable GPU N (a CUDA
    device on a CPU-only machine is refused here, not after the data is loaded)."""
    import torch  # here, not at the top: most parsers never need it

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cpu":
        return text
    backend = getattr(torch, device.type, None)
    if device.type == "meta" or backend is None or not hasattr(backend, "is_available"):
        raise argparse.ArgumentTypeError(f"{text}: not a device to compute on (expected cpu, cuda or cuda:N)")
    if not backend.is_available():
        build = "" if device.type != "cuda" or torch.version.cuda else f" (torch {torch.__version__} is a CPU-only build)"
        raise argparse.ArgumentTypeError(f"{text}: no {device.type.upper()} device is available on this machine{build}")
    count = backend.device_count()
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} {device.type.upper()} device(s), "
                                         f"numbered from 0")
    return text


def scratch_results(name: str) -> Path:
    """The default ``--out`` of a benchmark or study: ``$XDG_CACHE_HOME`` (or ``~/.cache``)/megaflex/``name``
    (``name``: what it writes under docs/results/), outside the repository. The committed results are
    written only when ``--out`` names them, so a default run never overwrites them, and a resumable
    study never reads their stored runs back as its own."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megaflex" / name


def _ensure_dir(path: Path, shown: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{shown}: cannot create {path} ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{shown}: {path} is not writable")
