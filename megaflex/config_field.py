"""``opt``: a config dataclass field that carries its documentation (bottom layer: imports nothing
from megaflex), shared by every config section so the reference in docs/training.md renders
from one place whichever package owns the section."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, doc: str) -> Any:
    """A documented dataclass field (lists/dicts get a default factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def required(doc: str) -> Any:
    """A documented dataclass field without a default."""
    return field(metadata={"doc": doc})
