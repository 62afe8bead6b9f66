"""Read documents from raw text, JSONL, or a Hugging Face dataset, streaming and lossless.

An input spec is one of

* ``PATH`` ending in ``.jsonl``/``.json`` (optionally ``.gz``): one JSON object per line, the
  document is its ``text_key`` field (default ``"text"``);
* any other ``PATH``: raw UTF-8 text, cut into documents by ``doc_mode`` (below);
* ``hf:NAME[:CONFIG[:SPLIT]]`` plus optional ``:key=value`` fields passed to
  ``datasets.load_dataset`` (``data_files``, ``split``, ``streaming``, ``revision``...), e.g.
  ``hf:wikitext:wikitext-103-raw-v1:train`` or, offline, ``hf:text:data_files=/d/wiki.valid.raw``.
  SPLIT defaults to ``train``. Each row's ``text_key`` field is a document, except in
  ``wikitext`` mode where rows are lines (see below).

``doc_mode`` for raw text (and HF rows):

* ``wikitext`` — documents are *articles*: a new one starts at a `` = Title = `` line (not at
  `` = = Section = = ``); lines before the first title join the first article. Every line keeps
  its ``\\n``, so the articles concatenate back to the file exactly. For HF rows (which are lines
  without, or for ``wikitext`` with, their ``\\n``; blank lines are ``""``) a missing ``\\n`` is
  restored, so HF blank rows become ``"\\n"`` where the raw file had ``" \\n"``.
* ``line`` — every non-blank line (without its ``\\n``) is a document.
* ``paragraph`` — blank-line separated blocks.
* ``file`` — the whole file (or each HF row) is one document.
* ``auto`` (default) — ``wikitext`` when the first non-blank line is a `` = Title = `` heading,
  else ``line`` for files and ``file`` (one row, one document) for HF datasets.

Invalid UTF-8 raises :class:`SourceError` with file and line, unless ``errors="replace"``.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from megaflex.hashing import sha256_file

DOC_MODES = ("auto", "wikitext", "line", "paragraph", "file")


class SourceError(ValueError):
    """An input cannot be read (missing, not UTF-8, bad JSON, missing key, empty...)."""


@dataclass(frozen=True)
class SourceSpec:
    """A parsed ``--input`` entry."""

    kind: str  # "text" | "jsonl" | "hf"
    path: str = ""  # for text/jsonl
    hf_name: str = ""
    hf_config: str | None = None
    hf_kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.kind != "hf":
            return self.path
        extra = "".join(f":{k}={v}" for k, v in sorted(self.hf_kwargs.items()))
        return f"hf:{self.hf_name}:{self.hf_config or ''}{extra}"


def parse_spec(spec: str) -> SourceSpec:
    """Parse ``PATH`` or ``hf:NAME[:CONFIG[:SPLIT]][:key=value...]``."""
    if spec.startswith("hf:"):
        parts = spec[3:].split(":")
        positional = [p for p in parts if "=" not in p]
        kwargs: dict[str, Any] = {}
        for p in parts:
            if "=" in p:
                k, v = p.split("=", 1)
                kwargs[k] = {"true": True, "false": False}.get(v.lower(), v)
        if not positional or not positional[0]:
            raise SourceError(f"input {spec!r}: expected hf:NAME[:CONFIG[:SPLIT]], got no NAME")
        if len(positional) > 3:
            raise SourceError(f"input {spec!r}: expected at most NAME, CONFIG, SPLIT, got {positional}")
        if len(positional) == 3:
            kwargs.setdefault("split", positional[2])
        kwargs.setdefault("split", "train")
        config = positional[1] if len(positional) > 1 and positional[1] else None
        return SourceSpec("hf", hf_name=positional[0], hf_config=config, hf_kwargs=kwargs)
    name = spec[:-3] if spec.endswith(".gz") else spec
    kind = "jsonl" if name.endswith((".jsonl", ".json")) else "text"
    return SourceSpec(kind, path=spec)


def _open_binary(path: str) -> io.BufferedIOBase:
    if not os.path.isfile(path):
        raise SourceError(f"{path}: input file not found")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decode(raw: bytes, path: str, lineno: int, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise SourceError(
            f"{path}:{lineno}: invalid UTF-8 byte {raw[e.start]:#04x} at column {e.start}; "
            f"fix the file or pass --encoding-errors replace"
        ) from None


def _text_lines(path: str, errors: str) -> Iterator[str]:
    """Lines of a text file, each with its ``\\n`` (the last may lack one)."""
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            yield _decode(raw, path, lineno, errors)


def is_wikitext_title(line: str) -> bool:
    """`` = Title = `` (an article heading), but not `` = = Section = = ``."""
    s = line.rstrip("\n")
    return len(s) > 6 and s.startswith(" = ") and s.endswith(" = ") and not s.startswith(" = = ")


def split_wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Group newline-terminated lines into articles; concatenating the output gives the input."""
    current: list[str] = []
    has_title = False
    for line in lines:
        if is_wikitext_title(line) and has_title:
            yield "".join(current)
            current = []
        has_title = has_title or is_wikitext_title(line)
        current.append(line)
    if current and any(l.strip() for l in current):
        yield "".join(current)


def _split_lines(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        s = line.rstrip("\n")
        if s.strip():
            yield s


def _split_paragraphs(lines: Iterable[str]) -> Iterator[str]:
    block: list[str] = []
    for line in itertools.chain(lines, ["\n"]):
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip("\n")
            block = []


def _resolve_mode(mode: str, first_lines: list[str], default: str) -> str:
    if mode not in DOC_MODES:
        raise SourceError(f"doc_mode: expected one of {DOC_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    first = next((l for l in first_lines if l.strip()), "")
    return "wikitext" if is_wikitext_title(first) else default


def _split(lines: Iterator[str], mode: str, default: str) -> Iterator[str]:
    head = list(itertools.islice(lines, 64))  # peek for auto-detection
    lines = itertools.chain(head, lines)
    mode = _resolve_mode(mode, head, default)
    if mode == "wikitext":
        return split_wikitext_articles(lines)
    if mode == "line":
        return _split_lines(lines)
    if mode == "paragraph":
        return _split_paragraphs(lines)
    return (d for d in ["".join(lines)] if d.strip())  # "file"


def _jsonl_docs(path: str, text_key: str, errors: str) -> Iterator[str]:
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno, errors)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                # json's own messages may end in "at" ("Invalid control character at"): drop it
                problem = e.msg.removesuffix(" at")
                raise SourceError(f"{path}:{lineno}: invalid JSON at column {e.colno}: {problem}") from None
            if not isinstance(obj, dict) or text_key not in obj:
                raise SourceError(f"{path}:{lineno}: no {text_key!r} key in the JSON object (set --json-key)")
            text = obj[text_key]
            if not isinstance(text, str):
                raise SourceError(f"{path}:{lineno}: {text_key!r} is {type(text).__name__}, expected a string")
            yield text


def load_hf(spec: SourceSpec) -> Iterable[dict]:
    """``datasets.load_dataset(NAME, CONFIG, **kwargs)`` (honours HF_DATASETS_OFFLINE and the cache)."""
    try:
        import datasets  # deferred: heavy import, only needed for hf: inputs
    except ImportError:
        raise SourceError(f"input {spec}: the datasets package is not installed; pip install 'megaflex[tools]'") from None

    try:
        return datasets.load_dataset(spec.hf_name, spec.hf_config, **spec.hf_kwargs)
    except FileNotFoundError as e:
        raise SourceError(f"input {spec}: {e}") from None


def _hf_docs(spec: SourceSpec, text_key: str, mode: str) -> Iterator[str]:
    def rows() -> Iterator[str]:
        for i, row in enumerate(load_hf(spec)):
            if text_key not in row:
                raise SourceError(f"input {spec}: row {i} has no {text_key!r} column (columns: {sorted(row)})")
            yield row[text_key]

    it = rows()
    head = list(itertools.islice(it, 64))
    it = itertools.chain(head, it)
    mode = _resolve_mode(mode, head, "file")
    if mode == "file":
        return it
    # rows are lines: put back the newline the loader removed (HF wikitext rows keep theirs)
    return _split((r if r.endswith("\n") else r + "\n" for r in it), mode, "file")


def iter_documents(
    spec: str | SourceSpec, text_key: str = "text", doc_mode: str = "auto", errors: str = "strict"
) -> Iterator[str]:
    """Stream the documents of one input (empty/whitespace-only documents are skipped)."""
    if errors not in ("strict", "replace"):
        raise SourceError(f"errors: expected 'strict' or 'replace', got {errors!r}")
    if doc_mode not in DOC_MODES:
        raise SourceError(f"doc_mode: expected one of {DOC_MODES}, got {doc_mode!r}")
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    if spec.kind == "jsonl":
        docs = _jsonl_docs(spec.path, text_key, errors)
    elif spec.kind == "text":
        docs = _split(_text_lines(spec.path, errors), doc_mode, "line")
    else:
        docs = _hf_docs(spec, text_key, doc_mode)
    return (d for d in docs if d.strip())


def iter_corpus(
    specs: Iterable[str], text_key: str = "text", doc_mode: str = "auto", errors: str = "strict"
) -> Iterator[str]:
    """Documents of several inputs in order; raises :class:`SourceError` if there are none."""
    specs = list(specs)
    check_inputs(specs)
    n = 0
    for s in specs:
        for doc in iter_documents(s, text_key, doc_mode, errors):
            n += 1
            yield doc
    if n == 0:
        raise SourceError(f"input: empty corpus, no non-blank documents in {specs}")


def check_inputs(specs: list[str]) -> None:
    """Fail on a missing file before spending time on the others."""
    if not specs:
        raise SourceError("input: expected at least one input, got none")
    for s in specs:
        p = parse_spec(s)
        if p.kind != "hf" and not os.path.isfile(p.path):
            raise SourceError(f"{p.path}: input file not found")


def input_size_bytes(specs: Iterable[str]) -> int | None:
    """Total bytes of file inputs (for a progress bar), None if any input is not a file."""
    total = 0
    for s in specs:
        p = parse_spec(s)
        if p.kind == "hf" or p.path.endswith(".gz"):
            return None
        total += os.path.getsize(p.path)
    return total


def fingerprint(spec: str) -> dict:
    """Provenance of one input for the tokenizer card: sha256 of the file(s)."""
    p = parse_spec(spec)
    if p.kind != "hf":
        return {"source": spec, "sha256": sha256_file(p.path)}
    files = p.hf_kwargs.get("data_files")
    out: dict[str, Any] = {"source": spec}
    if isinstance(files, str) and os.path.isfile(files):
        out["sha256"] = sha256_file(files)
    return out
