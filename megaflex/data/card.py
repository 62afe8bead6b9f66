"""Tokenizer identity and the data card ``PREFIX.card.json`` that ``data_prep.preprocess`` writes.

A tokenizer is identified by the sha256 of its model file and its vocabulary size (the path is
kept for messages only: a copied model is the same tokenizer, a retrained one under the same
path is not). The identity is recorded

* with the data: ``PREFIX.card.json`` next to ``PREFIX.bin``/``PREFIX.idx``;
* with checkpoints: ``CheckpointMeta.tokenizer`` (``megaflex.checkpoint``, written by the trainer);

and training, evaluation and generation refuse to combine records that disagree
(:func:`check_same_tokenizer`), so data tokenized with one tokenizer is never scored or trained
with another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megaflex.data.indexed import DataError, index_file_path
from megaflex.hashing import sha256_file

DATA_CARD_KIND = "megaflex-data"


class TokenizerMismatchError(DataError):
    """Two records of the tokenizer (data card, checkpoint, the tokenizer in use) disagree."""


def tokenizer_record(model_path: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
    """``{"sha256", "vocab_size", "path"}`` of a tokenizer model file."""
    return {"sha256": sha256_file(model_path), "vocab_size": int(vocab_size), "path": os.path.abspath(model_path)}


def check_same_tokenizer(expected: dict | None, actual: dict | None, expected_from: str, actual_from: str) -> None:
    """Raise :class:`TokenizerMismatchError` when both records exist and differ (None: unknown, not checked)."""
    if not expected or not actual:
        return
    if expected.get("sha256") != actual.get("sha256") or expected.get("vocab_size") != actual.get("vocab_size"):
        raise TokenizerMismatchError(
            f"tokenizer mismatch: {expected_from} was made with {expected.get('path')} "
            f"(vocab {expected.get('vocab_size')}, sha256 {str(expected.get('sha256'))[:12]}), but {actual_from} is "
            f"{actual.get('path')} (vocab {actual.get('vocab_size')}, sha256 {str(actual.get('sha256'))[:12]}); "
            f"use the same tokenizer (or re-tokenize the data with data_prep.preprocess)"
        )


def data_card_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.card.json")


def write_data_card(prefix: str | os.PathLike, tokenizer: dict[str, Any], **info: Any) -> Path:
    """Write ``PREFIX.card.json``: the tokenizer record plus ``info`` (documents, tokens, inputs...)
    and the size of ``PREFIX.idx`` (so a card left beside another .idx is noticed)."""
    path = data_card_path(prefix)
    card = {"kind": DATA_CARD_KIND, "tokenizer": tokenizer, **info}
    idx = Path(index_file_path(prefix))
    if idx.is_file():
        card["idx_size"] = idx.stat().st_size
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_data_card(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The data card of ``prefix``, or None when there is none (data made before cards existed)."""
    path = data_card_path(prefix)
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable data card ({e}); delete it or re-run data_prep.preprocess") from None
    if not isinstance(card, dict) or card.get("kind") != DATA_CARD_KIND:
        raise DataError(f"{path}: not a megaflex data card (expected \"kind\": \"{DATA_CARD_KIND}\")")
    _check_card_describes_the_idx(card, path, Path(index_file_path(prefix)))
    return card


def _check_card_describes_the_idx(card: dict[str, Any], path: Path, idx: Path) -> None:
    """DataError when the card was written for another ``.idx`` than the one beside it (a card left
    from another preprocessing run): another .idx size or document count. (Damage to an .idx of
    the same size is the structural checks' to name, with the offending pointers.)"""
    if not idx.is_file():
        return
    stale = None
    size = idx.stat().st_size
    if isinstance(card.get("idx_size"), int):
        if card["idx_size"] != size:
            stale = f"it describes an .idx of {card['idx_size']} bytes, {idx} has {size}"
    elif isinstance(card.get("documents"), int):  # a card from before idx_size was recorded
        from megaflex.data.indexed import IndexedDataset

        documents = IndexedDataset(idx.with_suffix("")).num_documents
        if documents != card["documents"]:
            stale = f"it describes {card['documents']} documents, {idx} holds {documents}"
    if stale:
        raise DataError(f"{path}: a data card from another preprocessing run ({stale}); re-run data_prep.preprocess "
                        "(with --overwrite) or delete the card if the data is right")


def data_tokenizer(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The tokenizer record of the data at ``prefix`` (None when it has no card)."""
    card = read_data_card(prefix)
    return card.get("tokenizer") if card else None
