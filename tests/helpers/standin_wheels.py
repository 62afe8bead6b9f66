"""Wheels made on the spot, without a package index, for the install tests of launch/.

- ``write_wheel``: a stand-in distribution (name, version, Requires-Dist, empty top-level packages);
- ``standin_of``: a stand-in of a distribution installed here, with its real name, version and
  dependencies, so that pip resolves and ``pip check`` checks the real dependency graph;
- ``repack``: a pure-Python distribution installed here as a real wheel (setuptools, packaging, ...:
  what a build backend imports, where an empty stand-in would not do; ``build_tool`` also takes
  setuptools' vendored copy of one that is not installed);
- ``closure``: the installed distributions a list of requirements needs, transitively.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What setuptools imports from the environment when installed there (before its vendored copies): real
# code, never an empty stand-in.
BUILD_TOOLS = {"setuptools", "wheel", "packaging", "typing-extensions", "platformdirs", "more-itertools", "zipp",
               "importlib-metadata", "tomli", "jaraco-text", "jaraco-functools", "jaraco-context"}  # fmt: skip


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes], metadata: str) -> Path:
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    files = {**files, f"{info}/METADATA": metadata.encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: megaflex-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        record = ""
        for arcname, data in files.items():
            whl.writestr(arcname, data)
            record += _record_line(arcname, data)
        whl.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return path


def write_wheel(folder: Path, name: str, version: str, requires: list[str] = (), packages: list[str] = (),
                files: dict[str, str] | None = None) -> Path:  # fmt: skip
    """A stand-in wheel: empty ``packages`` (``name/__init__.py``) plus ``files`` (path -> text)."""
    body = {f"{p}/__init__.py": b"" for p in packages} | {k: v.encode() for k, v in (files or {}).items()}
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    return _wheel(folder, name, version, body, metadata)


def top_level(dist: md.Distribution) -> list[str]:
    """The importable top-level names of an installed distribution."""
    text = dist.read_text("top_level.txt")
    if text:
        return [n for n in text.split() if n.isidentifier()]
    names = {f.parts[0].removesuffix(".py") for f in dist.files or () if f.suffix == ".py" and f.parts[0] != ".."}
    return sorted(n for n in names if n.isidentifier())


def standin_of(folder: Path, name: str, version: str | None = None) -> Path:
    """A stand-in of the installed distribution ``name``: its name, version (or ``version``) and
    Requires-Dist, and its top-level packages, empty."""
    dist = md.distribution(name)
    return write_wheel(folder, dist.metadata["Name"], version or dist.version, dist.requires or [], top_level(dist))


def repack(folder: Path, name: str, version: str | None = None, path: list[str] | None = None) -> Path:
    """The installed pure-Python distribution ``name`` (found on ``path``, default sys.path) as a
    wheel, its files as installed (``version`` overrides the version it declares: a stand-in of an
    older release)."""
    dist = next(iter(md.distributions(name=name, path=path))) if path else md.distribution(name)
    files, skip = {}, ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json", "METADATA", "WHEEL")
    for f in dist.files or ():
        if f.parts[0] == ".." or "__pycache__" in f.parts or (f.parts[0].endswith(".dist-info") and f.name in skip):
            continue
        located = Path(dist.locate_file(f))
        if located.is_file():  # a vendored copy's RECORD names scripts it does not hold
            files[str(f)] = located.read_bytes()
    metadata = dist.read_text("METADATA")
    if version:
        metadata = re.sub(r"^Version: .*$", f"Version: {version}", metadata, count=1, flags=re.M)
    version = version or dist.version
    info = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{version}.dist-info"
    files = {re.sub(r"^[^/]+\.dist-info/", f"{info}/", k): v for k, v in files.items()}
    return _wheel(folder, dist.metadata["Name"], version, files, metadata)


def closure(requirements: list[str], skip: set[str] = frozenset()) -> list[str]:
    """The canonical names of the installed distributions ``requirements`` need here (markers
    evaluated for this Python), transitively, less ``skip`` and what only ``skip`` needs."""
    found: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in skip or name in found:
            continue
        found.add(name)
        dist = md.distribution(name)
        todo += [(Requirement(r), e) for r in dist.requires or () for e in ("", *req.extras)]
    return sorted(found)


def write_sdist(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A stand-in source distribution built by setuptools (one empty package ``name``)."""
    import io
    import tarfile

    root = f"{name}-{version}"
    pyproject = (f'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
                 f'[project]\nname = "{name}"\nversion = "{version}"\ndependencies = {list(requires)!r}\n\n'
                 f'[tool.setuptools]\npackages = ["{name}"]\n')  # fmt: skip
    files = {f"{root}/pyproject.toml": pyproject, f"{root}/{name}/__init__.py": "",
             f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for arcname, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def build_tool(folder: Path, name: str) -> Path:
    """A real wheel of the build tool ``name`` (``wheel``, ...): the installed one, else setuptools' vendored copy."""
    try:
        return repack(folder, name)
    except md.PackageNotFoundError:
        vendored = Path(md.distribution("setuptools").locate_file("setuptools/_vendor"))
        return repack(folder, name, path=[str(vendored)])
