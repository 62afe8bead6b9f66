"""Local lm-evaluation-harness tasks whose perplexity equals ``megaflex-eval``'s (offline).

    python -m megaflex.hf.lm_eval_tasks --out tasks/ --hf-model hf/tiny      # tokenizer + length from an export
    lm_eval --model hf --model_args pretrained=hf/tiny,trust_remote_code=True \\
        --include_path tasks/ --tasks megaflex_wikitext2 --batch_size 4
    megaflex-eval --checkpoint runs/tiny --data tasks/megaflex_wikitext2.jsonl --mode windows --context 256

How the two count the same thing. lm-eval's ``loglikelihood_rolling`` scores a document
``[BOS] + tokens`` in windows of ``max_length`` inputs: disjoint from scratch, except that the
*last* window of a long document is re-extended backwards to a full ``max_length`` context,
which no ``megaflex-eval`` mode does. A document of at most ``max_length`` tokens is one window:
every token predicted from ``[BOS] + its prefix``. The exported tokenizer's BOS is megaflex's EOD,
so that is exactly ``megaflex-eval``'s ``[EOD] + encode(text)`` document in any mode with
``--context >= max_length``. So this writer cuts the source documents (WikiText-2 test articles
by default) into pieces of at most ``--max-tokens`` tokens (default: the model's max_seq_len) at
line boundaries (at spaces inside a too-long line), checks that each piece re-tokenises to
exactly its share of tokens, and stores them as a JSONL that both tools read. Whitespace-only
pieces are dropped (``megaflex-eval`` skips blank documents).

Metrics (``process_results`` in the generated ``megaflex_lm_eval_utils.py``): ``token_perplexity``
= exp(sum NLL / targets) (megaflex-eval's ``ppl``; target counts are stored per document),
``word_perplexity`` with megaflex's WikiText word count (its ``word_ppl``), ``bits_per_byte``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml

from megaflex.cli_args import positive_int
from megaflex.eval.eval_data import EVAL_DOC_MODES, count_words, text_documents

TASK = "megaflex_wikitext2"
UTILS_MODULE = "megaflex_lm_eval_utils"
_UTILS_SOURCE = '''"""process_results of the megaflex local perplexity task (written by megaflex.hf.lm_eval_tasks)."""


def process_results(doc, results):
    loglikelihood = results[0]
    return {
        "token_perplexity": (loglikelihood, doc["num_tokens"]),
        "word_perplexity": (loglikelihood, doc["words"]),
        "bits_per_byte": (loglikelihood, doc["bytes"]),
    }
'''


def split_document(text: str, encode: Callable[[str], list[int]], max_tokens: int) -> list[str]:
    """``text`` as consecutive pieces of at most ``max_tokens`` tokens, cut at line ends (or
    before a space within a longer line); ValueError when a cut changes the tokenisation."""
    segments = []
    for line in text.splitlines(keepends=True):
        if len(encode(line)) <= max_tokens:
            segments.append(line)
        else:
            segments += re.split(r"(?= )", line)  # before each space: a token boundary for these models
    pieces, current, count = [], "", 0
    for seg in segments:
        n = len(encode(seg))
        if n > max_tokens:
            raise ValueError(f"max_tokens: a single word of {n} tokens exceeds {max_tokens}: {seg[:40]!r}")
        if current and count + n > max_tokens:
            pieces.append(current)
            current, count = "", 0
        current, count = current + seg, count + n
    if current:
        pieces.append(current)
    for piece in pieces:
        if len(encode(piece)) > max_tokens:
            raise ValueError(f"max_tokens: a piece re-tokenises to more than {max_tokens} tokens (the tokenizer "
                             f"merges across line/space boundaries); starts {piece[:40]!r}")
    return [p for p in pieces if p.strip()]


def write_task(
    out_dir: str | Path, tokenizer_path: str | Path, max_tokens: int, *, data: str, doc_mode: str | None = "wikitext",
    max_docs: int | None = None, task: str = TASK,
) -> Path:
    """Write ``<task>.jsonl``, ``<task>.yaml`` and the metrics module into ``out_dir``; returns the YAML."""
    from megaflex.data.tokenizer import Tokenizer

    if max_tokens < 2:
        raise ValueError(f"max_tokens: expected >= 2, got {max_tokens}")
    tok = Tokenizer(tokenizer_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = text_documents(data, doc_mode)
    if max_docs is not None:
        texts = texts[:max_docs]
    jsonl = out / f"{task}.jsonl"
    with jsonl.open("w", encoding="utf-8") as f:
        for text in texts:
            for piece in split_document(text, tok.encode, max_tokens):
                record = {"text": piece, "num_tokens": len(tok.encode(piece)), "words": count_words(piece),
                          "bytes": len(piece.encode("utf-8"))}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    (out / f"{UTILS_MODULE}.py").write_text(_UTILS_SOURCE)
    config = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(jsonl.resolve())}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "process_results": f"!function {UTILS_MODULE}.process_results",
        "metric_list": [
            {"metric": "token_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
        "metadata": {"version": 1.0, "max_tokens": max_tokens, "source": data, "doc_mode": doc_mode},
    }
    text = yaml.safe_dump(config, sort_keys=False)
    # "!function" is a YAML tag for lm-eval's loader, not a string: unquote it.
    text = re.sub(r"'(!function [\w.]+)'", r"\1", text)
    path = out / f"{task}.yaml"
    path.write_text(text)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megaflex.hf.lm_eval_tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the task (pass it to lm_eval --include_path)")
    p.add_argument("--hf-model", default=None, help="a megaflex-export directory: its tokenizer and max_seq_len")
    p.add_argument("--tokenizer", default=None, help="tokenizer file: sentencepiece .model or tokenizer.json (instead of --hf-model)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="tokens per document (default: the model's max_seq_len)")
    p.add_argument("--data", default=None, help="text/.jsonl source (default: $MEGAFLEX_DATA wikitext-2 test)")
    p.add_argument("--doc-mode", choices=EVAL_DOC_MODES, default="wikitext", help="how the source is cut into documents")
    p.add_argument("--max-docs", type=positive_int, default=None, help="keep the first N source documents")
    p.add_argument("--task", default=TASK, help="task name")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: write the task files and print the lm_eval command."""
    import os

    args = build_parser().parse_args(argv)
    tokenizer, max_tokens = args.tokenizer, args.max_tokens
    if args.hf_model:
        from megaflex.hf.tokenizer import original_tokenizer_file

        hf_dir = Path(args.hf_model)
        config_file = hf_dir / "config.json"
        if not config_file.is_file():
            raise ValueError(f"--hf-model: expected a megaflex-export directory with config.json, got {args.hf_model!r}")
        tokenizer = tokenizer or original_tokenizer_file(hf_dir) or hf_dir / "tokenizer.json"
        max_tokens = max_tokens or json.loads(config_file.read_text())["max_seq_len"]
    if tokenizer is None or max_tokens is None:
        raise ValueError("--tokenizer and --max-tokens (or --hf-model DIR) are required")
    data = args.data or str(Path(os.environ.get("MEGAFLEX_DATA", "../shared/data")) / "wikitext-2-raw" / "wiki.test.raw")
    path = write_task(args.out, tokenizer, max_tokens, data=data, doc_mode=args.doc_mode, max_docs=args.max_docs,
                      task=args.task)
    print(f"wrote {path}\nlm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,max_length={max_tokens} "
          f"--include_path {args.out} --tasks {args.task}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
