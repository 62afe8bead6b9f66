"""Long Range Arena (Tay et al. 2020) data: ListOps, byte-level Text (IMDb) and Retrieval (AAN).

Every dataset yields dicts of tensors, unpadded but truncated to ``max_len``::

    {"input_ids": int64 [L], "attention_mask": bool [L], "label": int64 []}              # ListOps, Text
    {"input_ids_1": .., "attention_mask_1": .., "input_ids_2": .., "attention_mask_2": .., "label": ..}  # Retrieval

and :func:`collate_lra` pads a list of them into a batch (to the longest item, or to ``pad_to``
as LRA's ``padded_batch`` does). ``attention_mask`` is True on real tokens. Truncation is LRA's
(keep the first ``max_len`` ids); every dataset's ``num_truncated`` counts the rows it cuts (a pair:
either document), and its ``source`` names the file (or aclImdb folder) it reads. Id 0 is padding in
every vocabulary, id 1 the optional leading ``<cls>`` (``add_cls=True``; it counts towards
``max_len``). LRA itself feeds no ``<cls>``: its "CLS" pooling reads position 0, the first real token.

ListOps (``basic_{train,val,test}.tsv``, header ``Source\\tTarget``; written by LRA's generator or by
``python -m data_prep.listops``): whitespace-separated tokens from the fixed vocabulary
:data:`LISTOPS_VOCAB`. LRA's own pipeline ran these through ``tfds`` ``Tokenizer()``, whose default
``alphanum_only`` drops ``]``, ``(`` and ``)`` (and the ``[`` of ``[MAX``) -- without ``]`` the prefix
expressions are ambiguous. Here ``]`` is always kept. The parentheses of LRA's file form are
redundant given ``]`` and triple the length (a 2000-token expression is ~6000 tokens with them), so
``keep_parens=False`` (default) drops them: the sequence is then exactly the length LRA's
generator bounds (< 2000), and no information is lost.

Text (IMDb, LRA: tfds ``imdb_reviews``; label 1 = positive, test split also used for validation):
``path`` is either the aclImdb directory (``{train,test}/{pos,neg}/*.txt``, from
https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz) or one split's ``.jsonl`` file with
one ``{"text": str, "label": 0|1}`` object per line (e.g. exported from tfds). :func:`text_path` finds
a split in a folder: ``{train,test}.jsonl`` (``valid.jsonl`` when there is one, else the test split,
LRA's protocol) or aclImdb's ``train/`` and ``test/``.

Retrieval (AAN): LRA release ``lra_release.gz`` (https://storage.googleapis.com/long-range-arena/lra_release.gz),
files ``new_aan_pairs.{train,eval,test}.tsv``: no header, tab-separated ``label id1 id2 text1 text2``
with a float label (``0.0``/``1.0``) and no quoting (LRA reads them with ``use_quote_delim=False``);
the texts are taken as raw bytes (no UTF-8 check), aclImdb and JSONL texts must be UTF-8.

Byte-level ids (Text, Retrieval): UTF-8 byte ``b`` -> ``b + BYTE_OFFSET``; LRA's defaults are
``max_len`` 4000 per AAN document and, per the paper, 4K for Text (its released config uses 1000).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megaflex.data.indexed import DataError

PAD_ID = 0
CLS_ID = 1

# ---- ListOps vocabulary: fixed, so ids never depend on which file was read first (LRA built its
# vocabulary from the training set).
LISTOPS_OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")  # LRA's spellings; [SM is sum mod 10
LISTOPS_END, LISTOPS_OPEN, LISTOPS_CLOSE = "]", "(", ")"
LISTOPS_VOCAB: tuple[str, ...] = (
    ("<pad>", "<cls>", "<unk>") + tuple(str(d) for d in range(10)) + LISTOPS_OPERATORS
    + (LISTOPS_END, LISTOPS_OPEN, LISTOPS_CLOSE)
)
LISTOPS_TOKEN_TO_ID = {t: i for i, t in enumerate(LISTOPS_VOCAB)}
_LISTOPS_SPECIALS = 3
UNK_ID = LISTOPS_TOKEN_TO_ID["<unk>"]
LISTOPS_NUM_CLASSES = 10

# ---- byte vocabulary (Text, Retrieval)
SEP_ID = 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

AAN_COLUMNS = ("label", "id1", "id2", "text1", "text2")
AAN_SPLITS = {"train": "train", "valid": "eval", "val": "eval", "eval": "eval", "test": "test"}
LISTOPS_SPLITS = {"train": "train", "valid": "val", "val": "val", "test": "test"}

_AAN_HINT = ("get new_aan_pairs.{train,eval,test}.tsv from the LRA release lra_release.gz "
             "(https://storage.googleapis.com/long-range-arena/lra_release.gz, tsv_data/ folder)")
_IMDB_HINT = ("pass the aclImdb directory (train/pos, train/neg, test/pos, test/neg *.txt; "
              "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz) or a folder of train.jsonl and "
              'test.jsonl (and valid.jsonl, to select on a split other than test) of {"text": ..., "label": 0|1} lines')
_LISTOPS_HINT = "generate it with `python -m data_prep.listops --out DIR` or use LRA's listops_*/basic_*.tsv"


class LRAFormatError(DataError):
    """An LRA file that is missing or not in the expected format (the message names file and line)."""


# ----------------------------------------------------------------------------- ListOps tokens

# Fast path: each multi-character token becomes one character, so a whole line is mapped to ids by
# one bytes.translate (a 96k-line file encodes in seconds instead of a minute of dict look-ups).
_OP_CHARS = {op: chr(1 + i) for i, op in enumerate(LISTOPS_OPERATORS)}  # control chars: absent from sources
_CHAR_IDS = {**{str(d): LISTOPS_TOKEN_TO_ID[str(d)] for d in range(10)},
             **{c: LISTOPS_TOKEN_TO_ID[op] for op, c in _OP_CHARS.items()},
             LISTOPS_END: LISTOPS_TOKEN_TO_ID[LISTOPS_END], LISTOPS_OPEN: LISTOPS_TOKEN_TO_ID[LISTOPS_OPEN],
             LISTOPS_CLOSE: LISTOPS_TOKEN_TO_ID[LISTOPS_CLOSE]}
_BAD = 255
_TABLE = bytes(_CHAR_IDS.get(chr(i), _BAD) for i in range(256))
_PAREN_IDS = (LISTOPS_TOKEN_TO_ID[LISTOPS_OPEN], LISTOPS_TOKEN_TO_ID[LISTOPS_CLOSE])


def encode_listops(source: str, *, keep_parens: bool = False, strict: bool = True) -> list[int]:
    """Ids of the whitespace-separated ListOps tokens of ``source``.

    ``keep_parens=False`` drops ``(``/``)`` (keeps ``]``). An unknown token raises
    :class:`LRAFormatError` when ``strict``, else becomes ``<unk>``.
    """
    return _encode_listops_array(source, keep_parens=keep_parens, strict=strict).tolist()


def _encode_listops_array(source: str, *, keep_parens: bool, strict: bool) -> np.ndarray:
    tokens = source.split()
    packed = source if not any(c in source for c in _OP_CHARS.values()) else ""
    for op, c in _OP_CHARS.items():
        packed = packed.replace(op, c)
    packed = "".join(packed.split())
    ids = None
    if len(packed) == len(tokens) and packed.isascii():  # every token mapped to exactly one char
        ids = np.frombuffer(packed.encode("ascii").translate(_TABLE), dtype=np.uint8)
        if (ids == _BAD).any():
            ids = None
    if ids is None:  # slow path: unknown or glued tokens (e.g. "[MIN3"); name the first one
        out = []
        for t in tokens:
            i = LISTOPS_TOKEN_TO_ID.get(t)
            if i is None or i < _LISTOPS_SPECIALS:  # <pad>/<cls>/<unk> never appear in a source either
                if strict:
                    raise LRAFormatError(f"unknown ListOps token {t!r} (vocabulary: {' '.join(LISTOPS_VOCAB[3:])})")
                i = UNK_ID
            out.append(i)
        ids = np.asarray(out, dtype=np.uint8)
    if not keep_parens:
        ids = ids[(ids != _PAREN_IDS[0]) & (ids != _PAREN_IDS[1])]
    return ids


def decode_listops(ids: Sequence[int] | torch.Tensor) -> str:
    """Space-joined tokens of ``ids`` (padding removed): the inverse of :func:`encode_listops`."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return " ".join(LISTOPS_VOCAB[i] for i in ids if i != PAD_ID)


def listops_path(directory: str | os.PathLike, split: str, task: str = "basic") -> Path:
    """``DIR/{task}_{train,val,test}.tsv`` (LRA's names); ``split`` may also be ``valid``."""
    if split not in LISTOPS_SPLITS:
        raise ValueError(f"split: expected one of {sorted(LISTOPS_SPLITS)}, got {split!r}")
    return Path(directory) / f"{task}_{LISTOPS_SPLITS[split]}.tsv"


def _iter_listops_rows(path: str | os.PathLike) -> Iterator[tuple[int, int, str, int]]:
    """(byte offset, line number, source, label) of each data row of a ListOps TSV, checked."""
    path = Path(path)
    if not path.is_file():
        raise LRAFormatError(f"{path}: no such ListOps file; {_LISTOPS_HINT}")
    with open(path, "rb") as f:
        header = f.readline().decode("utf-8", "replace").rstrip("\r\n").split("\t")
        if header[:2] != ["Source", "Target"]:
            raise LRAFormatError(f"{path}:1: expected the header 'Source<TAB>Target', got {header[:2]!r}")
        offset, lineno = f.tell(), 1
        for raw in f:
            lineno += 1
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line:
                fields = line.split("\t")
                if len(fields) != 2:
                    raise LRAFormatError(f"{path}:{lineno}: expected 2 tab-separated fields (Source, Target), "
                                         f"got {len(fields)}")
                source, target = fields
                if not source.strip():
                    raise LRAFormatError(f"{path}:{lineno}: empty Source")
                label = _parse_label(target, LISTOPS_NUM_CLASSES, f"{path}:{lineno}")
                yield offset, lineno, source, label
            offset += len(raw)


def _parse_label(text: str, num_classes: int, where: str) -> int:
    # LRA writes ints ("7"); AAN labels are floats ("1.0"). Anything else is a broken file.
    try:
        value = float(text)
    except ValueError:
        raise LRAFormatError(f"{where}: label {text!r} is not a number") from None
    if value != int(value) or not 0 <= value < num_classes:
        raise LRAFormatError(f"{where}: label {text!r} is not an integer in [0, {num_classes})")
    return int(value)


def read_listops_tsv(path: str | os.PathLike, *, keep_parens: bool = False) -> list[tuple[list[int], int]]:
    """All (token ids, label) pairs of a ListOps TSV; raises :class:`LRAFormatError` naming the line."""
    out = []
    for _, lineno, source, label in _iter_listops_rows(path):
        try:
            out.append((encode_listops(source, keep_parens=keep_parens), label))
        except LRAFormatError as e:
            raise LRAFormatError(f"{path}:{lineno}: {e}") from None
    return out


# ----------------------------------------------------------------------------- datasets


def _item(ids: np.ndarray, max_len: int, add_cls: bool, suffix: str = "") -> dict[str, torch.Tensor]:
    t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    if add_cls:
        t = torch.cat([torch.tensor([CLS_ID]), t])
    t = t[:max_len]
    return {f"input_ids{suffix}": t, f"attention_mask{suffix}": torch.ones(len(t), dtype=torch.bool)}


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ValueError(f"max_len: expected >= 1, got {max_len}")


def _count_truncated(lengths: np.ndarray, max_len: int, add_cls: bool) -> int:
    """Rows whose ids (+ ``<cls>``) exceed ``max_len``; ``lengths`` [rows] or [rows, documents]."""
    cut = np.asarray(lengths).reshape(len(lengths), -1) + int(add_cls) > max_len
    return int(cut.any(axis=1).sum())


class ListOpsDataset(torch.utils.data.Dataset):
    """A ListOps TSV, encoded once into one flat uint8 array (about 100 MB for LRA's 96k train set)."""

    def __init__(self, path: str | os.PathLike, *, max_len: int = 2000, keep_parens: bool = False,
                 add_cls: bool = False) -> None:
        _check_max_len(max_len)
        self.path, self.max_len, self.add_cls = Path(path), max_len, add_cls
        chunks, labels = [], []
        for _, lineno, source, label in _iter_listops_rows(path):
            try:
                chunks.append(_encode_listops_array(source, keep_parens=keep_parens, strict=True))
            except LRAFormatError as e:
                raise LRAFormatError(f"{path}:{lineno}: {e}") from None
            labels.append(label)
        if not chunks:
            raise LRAFormatError(f"{path}: no examples after the header")
        lengths = np.array([len(c) for c in chunks], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._tokens = np.concatenate(chunks)
        self.labels = torch.tensor(labels, dtype=torch.int64)
        # truncation loses the end of an expression (and so its answer): make it visible
        self.num_truncated = _count_truncated(lengths, max_len, add_cls)
        self.lengths = lengths

    @property
    def source(self) -> str:
        return str(self.path)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = _item(self._tokens[self._offsets[i]:self._offsets[i + 1]], self.max_len, self.add_cls)
        item["label"] = self.labels[i]
        return item


def encode_bytes(text: str | bytes) -> np.ndarray:
    """Byte-level ids: UTF-8 byte ``b`` -> ``b + BYTE_OFFSET`` (int16)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int16) + BYTE_OFFSET


def decode_bytes(ids: Sequence[int] | torch.Tensor, errors: str = "replace") -> str:
    """Inverse of :func:`encode_bytes`; special ids (padding, ``<cls>``) are skipped."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode("utf-8", errors)


class _LineFile:
    """Random access to lines of a large file by byte offset (one open per process)."""

    def __init__(self, path: Path) -> None:
        self.path, self._f, self._pid = path, None, -1

    def read(self, offset: int) -> bytes:
        if self._f is None or self._pid != os.getpid():  # DataLoader workers must not share a handle
            self._f, self._pid = open(self.path, "rb"), os.getpid()
        self._f.seek(offset)
        return self._f.readline()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_f": None, "_pid": -1}


def _decode_utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LRAFormatError(f"{where}: not UTF-8 ({e})") from None


def text_path(directory: str | os.PathLike, split: str) -> tuple[Path, str]:
    """(path, split) a ``TextBytesDataset`` reads for ``split`` (train/valid/test) of the Text folder
    ``directory``: its ``{split}.jsonl`` when it holds ``train.jsonl``, else the aclImdb folder itself.
    ``valid`` is ``valid.jsonl`` when there is one, else the test split (LRA's protocol: IMDb has no
    validation split)."""
    if split not in ("train", "valid", "test"):
        raise ValueError(f"split: expected train, valid or test, got {split!r}")
    root = Path(directory)
    if (root / "train.jsonl").is_file():
        if split == "valid" and not (root / "valid.jsonl").is_file():
            split = "test"
        return root / f"{split}.jsonl", split
    return root, "test" if split == "valid" else split


class TextBytesDataset(torch.utils.data.Dataset):
    """LRA Text: IMDb reviews as bytes. ``path``: the aclImdb directory (``split`` train/test picks
    ``path/split/{pos,neg}``) or a ``.jsonl`` file of ``{"text", "label"}`` (``split`` is ignored).
    Texts are read on access; the index (file or line offset, label) is built and checked up front."""

    def __init__(self, path: str | os.PathLike, split: str = "train", *, max_len: int = 4096,
                 add_cls: bool = False, text_key: str = "text", label_key: str = "label") -> None:
        _check_max_len(max_len)
        self.path, self.max_len, self.add_cls = Path(path), max_len, add_cls
        self.text_key, self.label_key = text_key, label_key
        self._files: list[Path] = []  # aclImdb: one file per example
        self._offsets: list[int] = []  # JSONL: one line per example
        self._bytes: list[int] = []  # each text's length in bytes (truncation count)
        self.source = str(self.path / split) if self.path.is_dir() else str(self.path)
        if self.path.is_dir():
            self._index_acl(split)
        elif self.path.is_file() and self.path.suffix == ".jsonl":
            self._index_jsonl()
        elif self.path.is_file():
            raise LRAFormatError(f"{self.path}: expected a directory or a .jsonl file; {_IMDB_HINT}")
        else:
            raise LRAFormatError(f"{self.path}: no such file or directory; {_IMDB_HINT}")
        if not self.labels:
            raise LRAFormatError(f"{self.path}: no examples found; {_IMDB_HINT}")
        self.labels = torch.tensor(self.labels, dtype=torch.int64)
        self.num_truncated = _count_truncated(np.asarray(self._bytes, dtype=np.int64), max_len, add_cls)

    def _index_acl(self, split: str) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split: aclImdb has 'train' and 'test' (LRA validates on test), got {split!r}")
        self.labels = []
        for name, label in (("neg", 0), ("pos", 1)):
            d = self.path / split / name
            if not d.is_dir():
                raise LRAFormatError(f"{d}: missing; {_IMDB_HINT}")
            found = sorted(d.glob("*.txt"))  # sorted: the same order on every machine
            self._files += found
            self._bytes += [f.stat().st_size for f in found]
            self.labels += [label] * len(found)

    def _index_jsonl(self) -> None:
        self.labels = []
        with open(self.path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    obj = self._parse_jsonl(raw, lineno)
                    self._offsets.append(offset)
                    self._bytes.append(len(obj[self.text_key].encode("utf-8")))
                    self.labels.append(_parse_label(str(obj[self.label_key]), 2, f"{self.path}:{lineno}"))
                offset += len(raw)
        self._lines = _LineFile(self.path)

    def _read(self, i: int) -> bytes:
        if self._files:
            raw = self._files[i].read_bytes()
            _decode_utf8(raw, str(self._files[i]))
            return raw
        return self._parse_jsonl(self._lines.read(self._offsets[i]), -1)[self.text_key].encode("utf-8")

    def _parse_jsonl(self, raw: bytes, lineno: int) -> dict[str, Any]:
        where = f"{self.path}:{lineno}"
        try:
            obj = json.loads(_decode_utf8(raw, where))
        except json.JSONDecodeError as e:
            raise LRAFormatError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(self.text_key), str) or self.label_key not in obj:
            raise LRAFormatError(f"{where}: expected an object with a string {self.text_key!r} and a "
                                 f"{self.label_key!r} (0 negative, 1 positive)")
        return obj

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        raw = self._read(i)[: self.max_len]  # only the bytes that survive truncation are converted
        item = _item(encode_bytes(raw), self.max_len, self.add_cls)
        item["label"] = self.labels[i]
        return item


def aan_path(directory: str | os.PathLike, split: str) -> Path:
    """``DIR/new_aan_pairs.{train,eval,test}.tsv``; ``split`` may also be ``valid``/``val``."""
    if split not in AAN_SPLITS:
        raise ValueError(f"split: expected one of {sorted(AAN_SPLITS)}, got {split!r}")
    return Path(directory) / f"new_aan_pairs.{AAN_SPLITS[split]}.tsv"


def _split_aan_line(raw: bytes, where: str) -> list[bytes]:
    # bytes, not str: the model sees bytes, so a stray non-UTF-8 byte in a 4000-byte abstract is data,
    # not a reason to refuse the file
    fields = raw.rstrip(b"\r\n").split(b"\t")
    if len(fields) != len(AAN_COLUMNS):
        hint = " (a header line? LRA's AAN files have none)" if fields[:1] == [b"label"] else ""
        raise LRAFormatError(f"{where}: expected {len(AAN_COLUMNS)} tab-separated fields "
                             f"({' '.join(AAN_COLUMNS)}), got {len(fields)}{hint}")
    return fields


class RetrievalBytesDataset(torch.utils.data.Dataset):
    """LRA Retrieval: AAN citation pairs as two byte sequences, label 1 if the papers are linked.
    ``path``: a directory holding ``new_aan_pairs.{split}.tsv`` (split train/valid/eval/test) or the
    TSV itself. Lines are read on access; their offsets and labels are indexed and checked up front."""

    def __init__(self, path: str | os.PathLike, split: str = "train", *, max_len: int = 4000,
                 add_cls: bool = False) -> None:
        _check_max_len(max_len)
        path = Path(path)
        self.path = aan_path(path, split) if path.is_dir() else path
        self.max_len, self.add_cls = max_len, add_cls
        if not self.path.is_file():
            raise LRAFormatError(f"{self.path}: no such file; {_AAN_HINT}")
        self._offsets, labels, lengths = [], [], []
        with open(self.path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    where = f"{self.path}:{lineno}"
                    fields = _split_aan_line(raw, where)
                    labels.append(_parse_label(fields[0].decode("ascii", "replace"), 2, where))
                    self._offsets.append(offset)
                    lengths.append((len(fields[3]), len(fields[4])))
                offset += len(raw)
        if not labels:
            raise LRAFormatError(f"{self.path}: no examples; {_AAN_HINT}")
        self.labels = torch.tensor(labels, dtype=torch.int64)
        self.num_truncated = _count_truncated(np.asarray(lengths, dtype=np.int64), max_len, add_cls)
        self._lines = _LineFile(self.path)

    @property
    def source(self) -> str:
        return str(self.path)

    def __len__(self) -> int:
        return len(self.labels)

    def row(self, i: int) -> dict[str, bytes]:
        """The raw columns of example ``i`` (label, id1, id2, text1, text2), as bytes."""
        return dict(zip(AAN_COLUMNS, _split_aan_line(self._lines.read(self._offsets[i]), f"{self.path}[{i}]")))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        r = self.row(i)
        item = _item(encode_bytes(r["text1"][: self.max_len]), self.max_len, self.add_cls, "_1")
        item.update(_item(encode_bytes(r["text2"][: self.max_len]), self.max_len, self.add_cls, "_2"))
        item["label"] = self.labels[i]
        return item


# ----------------------------------------------------------------------------- batching


def collate_lra(batch: Sequence[dict[str, torch.Tensor]], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Stack items of any dataset above: ``input_ids*`` padded with ``PAD_ID``, ``attention_mask*``
    with False, to the batch's longest sequence or to ``pad_to`` (e.g. ``max_len``, as LRA does);
    other keys (``label``) are stacked. Use ``functools.partial(collate_lra, pad_to=N)`` in a DataLoader."""
    if not batch:
        raise ValueError("collate_lra: empty batch")
    out: dict[str, torch.Tensor] = {}
    for key in batch[0]:
        values = [b[key] for b in batch]
        if key.startswith(("input_ids", "attention_mask")):
            n = max(len(v) for v in values)
            if pad_to is not None:
                if n > pad_to:
                    raise ValueError(f"collate_lra: {key} has length {n} > pad_to={pad_to}")
                n = pad_to
            fill = PAD_ID if key.startswith("input_ids") else False
            padded = torch.full((len(values), n), fill, dtype=values[0].dtype)
            for row, v in zip(padded, values):
                row[: len(v)] = v
            out[key] = padded
        else:
            out[key] = torch.stack(values)
    return out
