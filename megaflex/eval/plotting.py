"""Small helpers shared by megaflex-eval, the benchmarks and the studies: JSON, Markdown tables and matplotlib plots
(headless: importing this module selects the Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

try:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
except ImportError:  # megaflex[tools] not installed (a GPU node's offline install): JSON and tables still work
    pass


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def line_plot(
    path: str | Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One PNG with a line per named series of (x, y) points."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], floatfmt: str = "{:.3f}") -> str:
    """A GitHub markdown table of ``rows`` (missing cells are blank, floats formatted)."""

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"
