"""Evaluation sets: documents of token ids from a ``.bin/.idx`` prefix, raw text, JSONL or ``hf:``.

What a document is (the unit whose first token has no context):

* ``PREFIX`` (``PREFIX.idx`` exists): the documents of the Megatron index, as preprocessed
  (``data_prep.preprocess`` appends EOD to each).
* a raw text file: the **whole file is one document** by default (``doc_mode="file"``) — the
  convention of published WikiText results, where the test split is one continuous stream;
  ``--doc-mode wikitext|line|paragraph`` cuts it into articles, lines or paragraphs instead.
* ``.jsonl``: one document per record (``text_key``).
* ``hf:NAME[:CONFIG[:SPLIT]]``: ``data_prep.sources`` rules (``auto``: WikiText articles, else
  one row per document); ``stream`` joins all rows back into one document (WikiText's rows are
  lines, so ``stream`` reproduces the raw split file).

Text documents are tokenized as ``[EOD] + encode(text)``: the leading EOD is the context the
model saw at every document boundary in training, so every token of the text is a target and
nothing else is (token ppl, bits per byte and word ppl all measure exactly the text). Indexed
documents get the same leading EOD; their stored trailing EOD is a target too (0 bytes).

``words`` is the WikiText word-level count of the text: whitespace-separated words plus one
``<eos>`` per line (245,569 for the WikiText-2/103 test split), so ``word_ppl`` =
``exp(sum NLL / words)`` compares with word-level WikiText tables (Megatron's "adjusted ppl").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

EVAL_DOC_MODES = ("file", "wikitext", "line", "paragraph", "auto", "stream")


@dataclass
class EvalSet:
    """Token documents plus what is needed to report per-word and per-byte numbers."""

    docs: list[torch.Tensor]  # each [T_d] int64
    words: int | None  # WikiText word-level count of the text (None when unknown)
    description: str

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.docs)


def count_words(text: str) -> int:
    """Whitespace-separated words plus one end-of-line token per line (WikiText's convention)."""
    if not text:
        return 0
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    return len(text.split()) + lines


def is_indexed_prefix(data: str) -> bool:
    return os.path.isfile(data + ".idx") and os.path.isfile(data + ".bin")


def text_documents(data: str, doc_mode: str | None = None, text_key: str = "text") -> list[str]:
    """Texts of ``data`` (raw text path, ``.jsonl`` or ``hf:...``) cut by the rules above."""
    from data_prep.sources import iter_documents, parse_spec

    spec = parse_spec(data)
    if doc_mode is not None and doc_mode not in EVAL_DOC_MODES:
        raise ValueError(f"doc_mode: expected one of {EVAL_DOC_MODES}, got {doc_mode!r}")
    if spec.kind != "hf" and not os.path.isfile(spec.path):
        raise ValueError(f"data: expected a .bin/.idx prefix, a text/.jsonl file or hf:NAME, got {data!r} (not found)")
    if doc_mode == "stream":
        # "wikitext" mode restores every line's newline and its articles concatenate losslessly
        return ["".join(iter_documents(spec, text_key, "wikitext"))]
    if doc_mode is None:
        doc_mode = "file" if spec.kind == "text" else "auto"
    return list(iter_documents(spec, text_key, doc_mode))


def tokenize_documents(texts: Iterable[str], tokenizer: Any, eod_id: int | None, prepend_eod: bool = True) -> list[torch.Tensor]:
    """``[EOD] + encode(text)`` per text (no EOD when ``eod_id`` is None or not ``prepend_eod``)."""
    docs = []
    for text in texts:
        ids = list(tokenizer.encode(text))
        if eod_id is not None and prepend_eod:
            ids = [eod_id] + ids
        docs.append(torch.tensor(ids, dtype=torch.long))
    return docs


def load_eval_set(
    data: str,
    tokenizer: Any = None,
    *,
    doc_mode: str | None = None,
    text_key: str = "text",
    prepend_eod: bool = True,
    max_docs: int | None = None,
    max_tokens: int | None = None,
) -> EvalSet:
    """Load ``data`` as token documents (see the module docstring for what a document is).

    ``max_docs`` keeps the first documents; ``max_tokens`` truncates the set to that many tokens
    (cutting the last document), for quick runs.
    """
    eod_id = getattr(tokenizer, "eod_id", None) if tokenizer is not None else None
    if eod_id is not None and eod_id < 0:
        eod_id = None
    words: int | None
    if is_indexed_prefix(data):
        from megaflex.data.indexed import IndexedDataset

        dataset = IndexedDataset(data)
        n = dataset.num_documents if max_docs is None else min(max_docs, dataset.num_documents)
        docs = []
        for i in range(n):
            ids = torch.from_numpy(np.asarray(dataset.document(i), dtype=np.int64))
            if prepend_eod and eod_id is not None:
                ids = torch.cat([torch.tensor([eod_id]), ids])
            docs.append(ids)
        words = None
        if tokenizer is not None:  # the text is recoverable for lossless tokenizers
            words = sum(count_words(tokenizer.decode(d.tolist())) for d in docs)
        description = f"{data} (.bin/.idx, {n} documents)"
    else:
        if tokenizer is None:
            raise ValueError(f"tokenizer: raw text {data!r} needs a tokenizer (pass --tokenizer or use a checkpoint that names one)")
        texts = text_documents(data, doc_mode, text_key)
        if max_docs is not None:
            texts = texts[:max_docs]
        if not texts:
            raise ValueError(f"data: no non-blank documents in {data!r}")
        docs = tokenize_documents(texts, tokenizer, eod_id, prepend_eod)
        words = sum(count_words(t) for t in texts)
        description = f"{data} ({len(texts)} documents, doc_mode={doc_mode or 'default'})"
    if max_tokens is not None:
        docs, words = _truncate(docs, max_tokens), None  # words no longer match the kept text
    return EvalSet(docs, words, description)


def _truncate(docs: list[torch.Tensor], max_tokens: int) -> list[torch.Tensor]:
    if max_tokens < 2:
        raise ValueError(f"max_tokens: expected >= 2, got {max_tokens}")
    kept, left = [], max_tokens
    for d in docs:
        if left <= 0:
            break
        kept.append(d[:left])
        left -= len(kept[-1])
    return kept
