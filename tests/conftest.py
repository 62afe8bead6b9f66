"""Shared test fixtures: locating the real-text data set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """Directory of the shared real-text data (env MEGAFLEX_DATA, default ../shared/data)."""
    return Path(os.environ.get("MEGAFLEX_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = data_root()
    if not (root / "wikitext-2-raw" / "wiki.valid.raw").is_file():
        pytest.skip(f"real-text data not found at {root} (set MEGAFLEX_DATA); CI refuses to run without it")
    return root
