"""Every relative link of README.md and docs/ (docs/results/README.md and each study's results.md
included) names a file that exists and, with ``#anchor``, a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {anchor(h) for h in headings}


def test_anchor_follows_github():
    assert anchor("Bidirectional (`model.causal: false`)") == "bidirectional-modelcausal-false"
    assert anchor("Layouts: one multi-node example each") == "layouts-one-multi-node-example-each"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in LINK_RE.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(f"{target}: no heading #{fragment}")
    assert not broken, broken
