"""The shape of the code, read from its imports: no import circles, imports only run down the
floors (attention <- model <- parallel <- checkpoint <- training/eval <- entry points), and the
wheel ships ``megaflex/`` and ``data_prep/`` only.

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a circle through a
function-level import is still a circle, it only fails later."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megaflex", "data_prep", "benchmarks", "studies")

# Lowest first; a module may import its own floor and the ones below. Keys are module prefixes
# (the longest match wins); entry points sit on the top floor.
FLOORS: dict[str, int] = {
    "megaflex.config_field": 0, "megaflex.hashing": 0, "megaflex.cli_args": 0,
    "megaflex.attention": 1,
    "megaflex.model": 2, "megaflex.data": 2,
    "megaflex.parallel": 3,
    "megaflex.checkpoint": 4,
    "megaflex.training": 5, "megaflex.eval": 5, "megaflex.output_dirs": 5,
    "megaflex.hf": 6, "megaflex.train": 6, "megaflex.distill": 6, "megaflex": 6,
    "data_prep": 7, "benchmarks": 7, "studies": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts}  # fmt: skip


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The repository modules ``name`` imports (``from pkg import mod`` names the module itself)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package faces left out:
    ``pkg/__init__`` re-exporting ``pkg.x`` while ``pkg.x`` imports ``pkg.y`` is no circle."""
    faces = {n for n in graph if any(m.startswith(n + ".") for m in graph)}
    edges = {n: {m for m in targets if m not in faces} for n, targets in graph.items() if n not in faces}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def _floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path):
    known = {"megaflex.a", "megaflex.b", "megaflex.pkg", "megaflex.pkg.c"}
    source = tmp_path / "a.py"
    source.write_text("import os\nfrom .pkg import c\n\ndef f():\n    from megaflex.b import thing\n")
    assert _imports("megaflex.a", source, known) == {"megaflex.b", "megaflex.pkg", "megaflex.pkg.c"}
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert _circles(graph) == [["x", "y", "z"]]


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_imports_run_down_the_floors():
    graph = _graph()
    upward = sorted(f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
                    for a, targets in graph.items() for b in targets if _floor(b) > _floor(a))  # fmt: skip
    assert upward == []
    assert len(graph) > 150 and graph["megaflex.model.gpt"]  # the reader found the code


@pytest.mark.slow
def test_the_wheel_ships_megaflex_and_data_prep_only(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("megaflex-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if not name.startswith("megaflex-")}
    assert tops == {"megaflex", "data_prep"}, tops


def _entry_points() -> list[str]:
    """The benchmark and study modules run as ``python -m``, and data_prep's."""
    names = []
    for pkg in ("benchmarks", "studies", "data_prep"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if '__name__ == "__main__"' in text or path.name == "__main__.py":
                names.append(_module_name(path).removesuffix(".__main__"))
    return names


@pytest.mark.slow
@pytest.mark.parametrize("module", _entry_points())
def test_every_entry_point_starts(module):
    """``python -m MODULE --help`` from a checkout: its imports resolve (e.g. a helper that moved)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-3000:]
