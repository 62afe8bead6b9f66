"""Evaluation sets: documents of token ids from a ``.bin/.idx`` prefix, raw text, JSONL or ``hf:``.

What a document is (the unit whose first token has no context):

* ``PREFIX`` (``PREFIX.idx`` exists): the documents of the Megatron index, as preprocessed
  (``data_prep.preprocess`` appends EOD to each).
* a raw text file: the **whole file is one document** by default (``doc_mode="file"``) — the
  convention of published WikiText results, where the test split is one continuous stream;
  ``--doc-mode wikitext|line|paragraph`` cuts it into articles, lines or paragraphs instead.
* ``.jsonl``: one document per record (``text_key``).
* ``hf:NAME[:CONFIG[:SPLIT]]``: ``megaflex.data.sources`` rules (``auto``: WikiText articles, else
  one row per document); ``stream`` joins all rows back into one document (WikiText's rows are
  lines, so ``stream`` reproduces the raw split file).

Text documents are tokenized as ``[EOD] + encode(text)``: the leading EOD is the context the
model saw at every document boundary in training, so every token of the text is a target and
nothing else is (token ppl, bits per byte and word ppl all measure exactly the text). Indexed
documents get the same leading EOD; their stored trailing EOD is a target too (0 bytes).

Tokenizer identity (``check_eval_tokenizer``): the tokenizer used must be the one recorded in
the checkpoint, and an indexed prefix's data card must name it too; ``load_eval_set`` with
``vocab_size`` refuses ids outside the model's vocabulary. Otherwise data tokenized with another
tokenizer would be scored and return a plausible, meaningless perplexity.

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

from megaflex.data.card import check_same_tokenizer, data_tokenizer
from megaflex.data.indexed import DataError

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


def check_eval_tokenizer(checkpoint_tokenizer: dict | None, tokenizer: Any, data: str | None, checkpoint: str) -> None:
    """Refuse a tokenizer, or an indexed prefix's data, made with another tokenizer than the checkpoint.

    ``checkpoint_tokenizer`` is the record in the checkpoint (None for checkpoints older than the
    record: then the tokenizer in use is the reference for the data)."""
    used = getattr(tokenizer, "record", None) if tokenizer is not None else None
    check_same_tokenizer(checkpoint_tokenizer, used, f"checkpoint {checkpoint}", "the tokenizer in use")
    if data is not None and is_indexed_prefix(data):
        reference = checkpoint_tokenizer or used
        where = f"checkpoint {checkpoint}" if checkpoint_tokenizer else "the tokenizer in use"
        check_same_tokenizer(reference, data_tokenizer(data), where, f"the data {data}")


def text_documents(data: str, doc_mode: str | None = None, text_key: str = "text", errors: str = "strict") -> list[str]:
    """Texts of ``data`` (raw text path, ``.jsonl`` or ``hf:...``) cut by the rules above."""
    from megaflex.data.sources import iter_documents, parse_spec

    spec = parse_spec(data)
    if doc_mode is not None and doc_mode not in EVAL_DOC_MODES:
        raise ValueError(f"doc_mode: expected one of {EVAL_DOC_MODES}, got {doc_mode!r}")
    if spec.kind != "hf" and not os.path.isfile(spec.path):
        raise ValueError(f"data: expected a .bin/.idx prefix, a text/.jsonl file or hf:NAME, got {data!r} (not found)")
    if doc_mode == "stream":
        # "wikitext" mode restores every line's newline and its articles concatenate losslessly
        return ["".join(iter_documents(spec, text_key, "wikitext", errors))]
    if doc_mode is None:
        doc_mode = "file" if spec.kind == "text" else "auto"
    return list(iter_documents(spec, text_key, doc_mode, errors))


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
    encoding_errors: str = "strict",
    vocab_size: int | None = None,
) -> EvalSet:
    """Load ``data`` as token documents (see the module docstring for what a document is).

    ``max_docs`` keeps the first documents; ``max_tokens`` truncates the set to that many tokens
    (cutting the last document), for quick runs. ``encoding_errors="replace"`` reads invalid
    UTF-8 as U+FFFD. With ``vocab_size``, an id outside ``[0, vocab_size)`` raises :class:`DataError`.
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
        texts = text_documents(data, doc_mode, text_key, encoding_errors)
        if max_docs is not None:
            texts = texts[:max_docs]
        if not texts:
            raise ValueError(f"data: no non-blank documents in {data!r}")
        docs = tokenize_documents(texts, tokenizer, eod_id, prepend_eod)
        words = sum(count_words(t) for t in texts)
        description = f"{data} ({len(texts)} documents, doc_mode={doc_mode or 'default'})"
    if vocab_size is not None:
        for i, d in enumerate(docs):
            if len(d) and (int(d.max()) >= vocab_size or int(d.min()) < 0):
                raise DataError(
                    f"data: document {i} of {data} holds token id {int(d.max())}, outside the model's vocabulary "
                    f"of {vocab_size}; the data was tokenized with another tokenizer"
                )
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
