"""Shared means public: no module reaches into another module's private names.

A leading underscore says "only this module uses it" (for a ``_module``: only its own package).
Three ways to break that are read from the source: ``from X import _name``, importing a private
``_module`` from outside its package, and ``mod._name`` on an imported repository module.
Dunders (``__version__``) are public by convention and left out."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megaflex", "data_prep", "benchmarks", "studies", "launch")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for pkg in PACKAGES if (root / pkg).is_dir()
            for p in sorted((root / pkg).rglob("*.py")) if "__pycache__" not in p.parts}  # fmt: skip


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _private_module_crossing(importer: str, target: str, is_package: bool) -> bool:
    """``target`` has a private part (a ``_module``) whose package is not ``importer``'s own."""
    parts = target.split(".")
    home = _package_of(importer, is_package)
    for i, part in enumerate(parts):
        if not _private(part):
            continue
        owner, private = ".".join(parts[:i]), ".".join(parts[: i + 1])
        # its own package's modules may use it (not subpackages: they are other packages)
        inside = importer == private or importer.startswith(private + ".") or home == owner
        if not inside:
            return True
    return False


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if not node.level:
        return base
    anchor = _package_of(importer, is_package).split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([base] if base else []))


def crossings(name: str, path: Path, known: set[str]) -> list[str]:
    """Every private name or module that module ``name`` (at ``path``) takes from another module."""
    is_package = path.name == "__init__.py"
    found: list[str] = []
    aliases: dict[str, str] = {}  # a local name -> the repository module it is bound to
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    if _private_module_crossing(name, alias.name, is_package):
                        found.append(f"{name}:{node.lineno} imports {alias.name}")
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node)
            if base.split(".")[0] not in PACKAGES:
                continue
            if _private_module_crossing(name, base, is_package):
                found.append(f"{name}:{node.lineno} imports {base}")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:  # a module: private if outside its package
                    if _private_module_crossing(name, full, is_package):
                        found.append(f"{name}:{node.lineno} imports {full}")
                    aliases[alias.asname or alias.name] = full
                elif _private(alias.name) and base != name:
                    found.append(f"{name}:{node.lineno} imports {alias.name} from {base}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target = _dotted(node.value, aliases)
            if target is not None and target in known and target != name:
                found.append(f"{name}:{node.lineno} reads {target}.{node.attr}")
    return found


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The repository module an expression like ``pkg.mod`` or an alias names, else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        return f"{head}.{node.attr}" if head is not None else None
    return None


def all_crossings(root: Path = REPO) -> list[str]:
    modules = _modules(root)
    known = set(modules)
    return sorted(c for name, path in modules.items() for c in crossings(name, path, known))


def test_the_reader_sees_each_kind_of_crossing(tmp_path):
    pkg = tmp_path / "megaflex"
    (pkg / "sub").mkdir(parents=True)
    for rel in ("__init__.py", "sub/__init__.py", "sub/_hidden.py", "sub/sibling.py", "a.py", "b.py"):
        (pkg / rel).write_text("")
    (pkg / "a.py").write_text("_own = 1\n__all__ = []\nprint(_own)\n")
    (pkg / "sub/sibling.py").write_text("from . import _hidden\nfrom ._hidden import thing\n")
    (pkg / "b.py").write_text(
        "import megaflex.a\nfrom megaflex import a as alias\nfrom .a import _own, __all__\n"
        "from .sub import _hidden\nfrom .sub._hidden import public\n"
        "print(megaflex.a._own, alias._own, alias.__all__, alias.public)\n"
    )
    assert all_crossings(tmp_path) == [
        "megaflex.b:3 imports _own from megaflex.a",
        "megaflex.b:4 imports megaflex.sub._hidden",
        "megaflex.b:5 imports megaflex.sub._hidden",
        "megaflex.b:6 reads megaflex.a._own",
        "megaflex.b:6 reads megaflex.a._own",
    ]


def test_no_module_imports_another_modules_private_name():
    found = all_crossings()
    assert found == [], "\n".join(found)
