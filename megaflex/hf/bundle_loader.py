"""Runtime half of the ``trust_remote_code`` bundle (copied verbatim into every export).

``megaflex-export`` writes this file's source to ``DIR/megaflex_bundle.py`` followed by a
``SOURCES`` dict: the text of megaflex's own attention, model and hf modules at export time.
``load(module)`` imports them from that dict under a private package name derived from their
hash, rewriting only the ``megaflex`` prefix of import statements. So a user without megaflex
runs exactly the code megaflex ran, and an installed megaflex (of any version) is never touched.
This file imports nothing outside the standard library: transformers copies it (a relative
import of the modelling file) into its module cache and checks its imports.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import re
import sys
import types

SOURCES: dict[str, str] = {}  # "megaflex/attention/core.py" -> source text; filled in by the export

_IMPORT_RE = re.compile(r"^(\s*)(from|import)(\s+)megaflex(?=[\s.])", flags=re.MULTILINE)


class _BundleImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<root>.x.y`` as ``megaflex/x/y.py`` (or ``megaflex/x/y/__init__.py``) in ``sources``."""

    def __init__(self, root: str, sources: dict[str, str]) -> None:
        self.root, self.sources = root, sources

    def _file(self, fullname: str) -> tuple[str, bool] | None:
        if fullname != self.root and not fullname.startswith(self.root + "."):
            return None
        parts = ["megaflex", *[p for p in fullname[len(self.root):].split(".") if p]]
        package = "/".join(parts + ["__init__.py"])
        if package in self.sources:
            return package, True
        module = "/".join(parts) + ".py"
        return (module, False) if module in self.sources else None

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        found = self._file(fullname)
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=f"bundle:{found[0]}", is_package=found[1])

    def create_module(self, spec: object) -> None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        filename, _ = self._file(module.__name__)
        code = _IMPORT_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{self.root}", self.sources[filename])
        exec(compile(code, f"<megaflex bundle>/{filename}", "exec"), module.__dict__)


def load(module: str, sources: dict[str, str] | None = None) -> types.ModuleType:
    """Import bundled ``megaflex.<module>`` (e.g. "hf.modeling") from ``sources`` (default SOURCES)."""
    sources = SOURCES if sources is None else sources
    digest = hashlib.sha256("\0".join(f"{k}\0{sources[k]}" for k in sorted(sources)).encode()).hexdigest()[:16]
    root = f"_megaflex_bundle_{digest}"
    if not any(isinstance(f, _BundleImporter) and f.root == root for f in sys.meta_path):
        sys.meta_path.append(_BundleImporter(root, sources))
    return importlib.import_module(f"{root}.{module}")
