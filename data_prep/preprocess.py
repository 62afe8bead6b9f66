"""Tokenize a corpus into megatron-format ``PREFIX.bin``/``PREFIX.idx`` (one sequence per document).

    python -m data_prep.preprocess --input wiki.train.raw --tokenizer tok/wt103.model \\
        --output-prefix data/wt103_train --num-proc 8

Documents stream from the inputs (see ``megaflex.data.sources``) in batches of about
``--batch-chars`` characters; ``--num-proc`` workers tokenize them while at most
``2 * num_proc`` batches are in flight, and the writer appends tokens straight to disk, so memory
stays bounded however large the corpus. Output order equals input order for any ``num_proc``
(the files are byte-identical). Each document ends with the EOD (= EOS) token.
``--docs-per-shard N`` writes ``PREFIX_00000``, ``PREFIX_00001``, ... instead; concatenate them
with ``python -m data_prep.merge``. Every output prefix gets a data card ``PREFIX.card.json``
recording the tokenizer (sha256, vocab size, path), which training and evaluation check.
Existing outputs are not replaced unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megaflex.data.sources import DOC_MODES, check_inputs, input_size_bytes, iter_corpus
from megaflex.data.card import data_card_path, write_data_card
from megaflex.data.indexed import IndexedDatasetBuilder, check_vocab_fits, data_file_path, index_file_path, optimal_dtype
from megaflex.data.tokenizer import Tokenizer


@dataclass
class PreprocessConfig:
    inputs: list[str]
    tokenizer: str  # path to P.model or a tokenizers P.json
    output_prefix: str
    num_proc: int = 1
    dtype: str = "auto"  # "auto" (uint16 if the vocab fits, else int32) or a numpy dtype name
    append_eod: bool = True
    prepend_bos: bool = False
    docs_per_shard: int = 0  # 0: one output
    batch_chars: int = 1 << 20
    text_key: str = "text"
    doc_mode: str = "auto"
    encoding_errors: str = "strict"
    progress: bool = True
    overwrite: bool = False  # replace existing outputs (refused otherwise)

    def __post_init__(self) -> None:
        if self.num_proc < 1:
            raise ValueError(f"num_proc: expected >= 1, got {self.num_proc}")
        if self.docs_per_shard < 0:
            raise ValueError(f"docs_per_shard: expected >= 0, got {self.docs_per_shard}")


# ----------------------------------------------------------------------------- workers
_TOK: Tokenizer | None = None
_FLAGS: tuple[bool, bool] = (True, False)


def _init_worker(model_path: str, append_eod: bool, prepend_bos: bool) -> None:
    global _TOK, _FLAGS
    _TOK = Tokenizer(model_path)
    _FLAGS = (append_eod, prepend_bos)


def _encode_batch(docs: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (all tokens int32, tokens per document, UTF-8 bytes of the batch)."""
    assert _TOK is not None
    append_eod, prepend_bos = _FLAGS
    encoded = _TOK.encode_batch(docs)
    if prepend_bos:
        encoded = [[_TOK.bos_id] + e for e in encoded]
    if append_eod:
        encoded = [e + [_TOK.eod_id] for e in encoded]
    lengths = np.fromiter((len(e) for e in encoded), np.int64, len(encoded))
    flat = np.array(list(itertools.chain.from_iterable(encoded)), dtype=np.int32)
    return flat, lengths, sum(len(d.encode("utf-8")) for d in docs)


def _batches(docs: Iterator[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_batches(cfg: PreprocessConfig) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Encoded batches in input order, with at most 2*num_proc batches in flight."""
    batches = _batches(iter_corpus(cfg.inputs, cfg.text_key, cfg.doc_mode, cfg.encoding_errors), cfg.batch_chars)
    if cfg.num_proc == 1:
        _init_worker(cfg.tokenizer, cfg.append_eod, cfg.prepend_bos)
        yield from map(_encode_batch, batches)
        return
    # Pool.imap would read the whole input ahead of the workers; a bounded deque keeps memory flat.
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (sentencepiece, torch)
    with ctx.Pool(cfg.num_proc, _init_worker, (cfg.tokenizer, cfg.append_eod, cfg.prepend_bos)) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 2 * cfg.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def existing_outputs(output_prefix: str, sharded: bool) -> list[str]:
    """Files a run with this output prefix would replace (``.bin``, ``.idx``, card; shards too)."""
    prefixes = sorted({p[: -len(".idx")] for p in glob.glob(glob.escape(output_prefix) + "_[0-9]*.idx")}) if sharded else []
    paths = [f(p) for p in [output_prefix, *prefixes] for f in (data_file_path, index_file_path, data_card_path)]
    return [str(p) for p in paths if os.path.exists(p)]


def refuse_overwrite(paths: list[str]) -> None:
    """Raise FileExistsError naming the outputs that exist (callers pass ``--overwrite`` to replace)."""
    if paths:
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        raise FileExistsError(f"output-prefix: {shown} already exist; pass --overwrite to replace them")


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run the pipeline; returns stats (prefixes, documents, tokens, bytes, seconds)."""
    check_inputs(cfg.inputs)
    if not cfg.overwrite:
        refuse_overwrite(existing_outputs(cfg.output_prefix, bool(cfg.docs_per_shard)))
    tok = Tokenizer(cfg.tokenizer)
    dtype = optimal_dtype(tok.vocab_size) if cfg.dtype == "auto" else np.dtype(cfg.dtype)
    check_vocab_fits(tok.vocab_size, dtype)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    total_bytes = input_size_bytes(cfg.inputs)
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)
    prefixes: list[str] = []
    builder: IndexedDatasetBuilder | None = None
    n_docs = n_tokens = n_bytes = 0

    def finalize(b: IndexedDatasetBuilder) -> None:
        b.finalize()
        write_data_card(b.prefix, tok.record, inputs=list(cfg.inputs), dtype=str(dtype), documents=b.num_documents,
                        append_eod=cfg.append_eod, prepend_bos=cfg.prepend_bos, eod_id=tok.eod_id)

    def new_builder() -> IndexedDatasetBuilder:
        prefix = f"{cfg.output_prefix}_{len(prefixes):05d}" if cfg.docs_per_shard else cfg.output_prefix
        prefixes.append(prefix)
        return IndexedDatasetBuilder(prefix, dtype=dtype, vocab_size=tok.vocab_size)

    try:
        for flat, lengths, nbytes in _encoded_batches(cfg):
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for i in range(len(lengths)):
                if builder is None:
                    builder = new_builder()
                builder.add_document(flat[starts[i] : starts[i + 1]])
                if cfg.docs_per_shard and builder.num_documents >= cfg.docs_per_shard:
                    finalize(builder)
                    builder = None
            n_docs += len(lengths)
            n_tokens += int(starts[-1])
            n_bytes += nbytes
            if bar is not None:
                bar.update(nbytes)
        if builder is not None:
            finalize(builder)
            builder = None
    except BaseException:
        if builder is not None:
            builder.__exit__(RuntimeError, None, None)  # removes the partial *.tmp files
        raise
    finally:
        if bar is not None:
            bar.close()
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    stats = {
        "prefixes": prefixes, "documents": n_docs, "tokens": n_tokens, "text_bytes": n_bytes,
        "seconds": seconds, "dtype": str(dtype), "num_proc": cfg.num_proc,
        "mb_per_s": n_bytes / 1e6 / seconds, "tokens_per_s": n_tokens / seconds,
        # CPU time of this process and its (reaped) workers: throughput independent of machine load
        "cpu_seconds": cpu, "mb_per_cpu_s": n_bytes / 1e6 / max(cpu, 1e-9),
    }
    print(
        f"wrote {', '.join(prefixes)}: {n_docs} documents, {n_tokens} tokens ({dtype}), "
        f"{n_bytes / 1e6:.1f} MB in {seconds:.1f}s = {stats['mb_per_s']:.2f} MB/s, {stats['tokens_per_s']:.0f} tok/s",
        file=sys.stderr,
    )
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="text files, .jsonl files, or hf:NAME[:CONFIG[:SPLIT]][:key=value]")
    ap.add_argument("--tokenizer", required=True, help="P.model or P.json (tokenizer.json) from data_prep.train_tokenizer")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--num-proc", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="auto (uint16 if the vocab fits, else int32), uint16 or int32")
    ap.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    ap.add_argument("--prepend-bos", action="store_true")
    ap.add_argument("--docs-per-shard", type=int, default=0, help="write PREFIX_00000... shards of N documents")
    ap.add_argument("--batch-chars", type=int, default=1 << 20)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--doc-mode", choices=DOC_MODES, default="auto")
    ap.add_argument("--encoding-errors", choices=["strict", "replace"], default="strict",
                    help="strict: stop at invalid UTF-8 naming file and line; replace: use U+FFFD")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--overwrite", action="store_true", help="replace existing PREFIX.bin/.idx/.card.json")
    a = ap.parse_args(argv)
    try:
        cfg = PreprocessConfig(
            inputs=a.input, tokenizer=a.tokenizer, output_prefix=a.output_prefix, num_proc=a.num_proc,
            dtype=a.dtype, append_eod=a.append_eod, prepend_bos=a.prepend_bos, docs_per_shard=a.docs_per_shard,
            batch_chars=a.batch_chars, text_key=a.json_key, doc_mode=a.doc_mode,
            encoding_errors=a.encoding_errors, progress=a.progress, overwrite=a.overwrite,
        )
        preprocess(cfg)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # SourceError, IndexedDatasetError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
