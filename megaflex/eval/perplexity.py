"""``megaflex-eval``: perplexity and bits per byte of a checkpoint, on one or many ranks.

    megaflex-eval --checkpoint runs/tiny --data ../shared/data/wikitext-2-raw/wiki.test.raw \\
        --mode stateful --context 2048 --json out.json --plot out.png
    torchrun --nproc-per-node 4 -m megaflex.eval.perplexity --checkpoint ... --data PREFIX \\
        --tensor-parallel-size 2 --mode sliding --context 1024 --stride 512

``--data`` is a ``.bin/.idx`` prefix, a raw text file, a ``.jsonl`` file or ``hf:NAME[:CONFIG
[:SPLIT]]`` (tokenised on the fly with the checkpoint's tokenizer); see ``megaflex.eval.eval_data``
for what a document is and ``megaflex.eval.scoring`` for exactly what is counted. In short:
``ppl = exp(mean NLL over every target token)``, ``bits_per_byte`` divides the same summed NLL
by ``ln 2 x`` UTF-8 bytes of the targets, and ``word_ppl`` by the WikiText word count (words +
one per line), which is how word-level WikiText-103 tables report subword models.

``--contexts 512,1024,...`` adds a sweep: the mode re-run at each context length (windows or
sliding, one console line each; in stateful mode the context is only the chunk size and cannot
change the result, so ``--contexts`` is refused there and the curve is perplexity by position in
the document instead). Both go to the JSON and the PNG.
Under ``torchrun`` the work is split over data-parallel ranks (each TP group evaluates the same
windows) and the sums are all-reduced; the result equals a single-process run up to float
summation order.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Sequence

import torch

from megaflex.cli_args import available_device, positive_int, positive_int_list, writable_file
from megaflex.eval.eval_data import EVAL_DOC_MODES, check_eval_tokenizer, load_eval_set
from megaflex.eval.scoring import MODES, evaluate

COUNTING = (
    "ppl = exp(sum NLL / tokens) over every target token (each document's first token, an EOD "
    "context token for text inputs, is not a target); bits_per_byte = sum NLL / (ln2 * UTF-8 bytes "
    "of the targets); word_ppl = exp(sum NLL / words), words = whitespace words + 1 per line"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaflex-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint folder, checkpoint.dir, or run dir")
    p.add_argument("--data", required=True, help=".bin/.idx prefix, text file, .jsonl, or hf:NAME[:CONFIG[:SPLIT]]")
    p.add_argument("--mode", choices=MODES, default="windows")
    p.add_argument("--context", type=positive_int, default=None,
                   help="window length / stateful chunk (default: model max_seq_len)")
    p.add_argument("--stride", type=positive_int, default=None, help="sliding mode: window advance (default context/2)")
    p.add_argument("--contexts", type=positive_int_list, default=[],
                   help="comma-separated context lengths to sweep, e.g. 512,1024,2048")
    p.add_argument("--json", type=writable_file, default=None, help="write the results here (rank 0)")
    p.add_argument("--plot", type=writable_file, default=None, help="PNG of perplexity vs context length (rank 0)")
    p.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer model")
    p.add_argument("--doc-mode", choices=EVAL_DOC_MODES, default=None, help="how text is cut into documents")
    p.add_argument("--text-key", "--json-key", dest="text_key", default="text",
                   help="JSON/HF field holding the text (--json-key: data_prep's name for it)")
    p.add_argument("--encoding-errors", choices=["strict", "replace"], default="strict",
                   help="strict: stop at invalid UTF-8 naming file and line; replace: read it as U+FFFD")
    p.add_argument("--no-prepend-eod", action="store_true", help="do not prepend EOD (first token not scored)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-docs", type=positive_int, default=None)
    p.add_argument("--max-tokens", type=positive_int, default=None, help="truncate the eval set (quick runs)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    p.add_argument("--tag", default=None, help="checkpoint tag (default latest)")
    p.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def _distributed(tp_size: int) -> tuple[Any, Any]:
    """(ParallelState, TP RNG tracker) under torchrun, else (None, None) for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and tp_size == 1:
        return None, None
    from megaflex.parallel import initialize_parallel_state, model_parallel_seed

    state = initialize_parallel_state(tp_size)
    return state, model_parallel_seed(0, state.tp_rank)


def run_eval(
    model: torch.nn.Module,
    docs: list[torch.Tensor],
    mode: str,
    context: int,
    *,
    stride: int | None = None,
    contexts: Sequence[int] = (),
    words: int | None = None,
    token_bytes: torch.Tensor | None = None,
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
) -> dict[str, Any]:
    """The JSON-ready results of one evaluation plus an optional context sweep."""
    common = dict(batch_size=batch_size, token_bytes=token_bytes, rank=rank, world_size=world_size, group=group)
    start = time.perf_counter()
    result = evaluate(model, docs, mode, context, stride, **common)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = result.to_dict()
    out.update(
        mode=mode, context=context, stride=stride if mode == "sliding" else None,
        word_ppl=math.exp(result.nll_sum / words) if words else None, words=words,
        num_documents=len(docs), eval_seconds=seconds, tokens_per_second=result.tokens / seconds if seconds else None,
        counting=COUNTING,
    )
    sweep = []
    for c in contexts:
        if mode == "stateful":
            break  # the result does not depend on the chunk length; see by_context instead
        s = None if mode == "windows" else max(1, c // 2) if stride is None else min(stride, c)
        r = evaluate(model, docs, mode, c, s, **common)
        sweep.append({"context": c, "stride": s, "ppl": r.ppl, "bits_per_byte": r.bits_per_byte, "tokens": r.tokens})
    out["context_sweep"] = sweep
    return out


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: ppl vs context (sweep) and ppl by position in the document (context buckets)."""
    from megaflex.eval.plotting import line_plot

    series = {}
    if results["context_sweep"]:
        series[f"{results['mode']}: ppl vs window length"] = [(r["context"], r["ppl"]) for r in results["context_sweep"]]
    series[f"{results['mode']}: ppl of targets by context seen"] = [
        (r["context_max"], r["ppl"]) for r in results["by_context"]
    ]
    line_plot(path, series, title="Perplexity vs context length", xlabel="context (tokens)", ylabel="perplexity",
              logx=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megaflex-eval``: exit status 0 (results printed / written), 2 on bad input."""
    from megaflex.eval.loading import USER_ERRORS

    try:
        run_cli(argv)
    except USER_ERRORS as e:  # DataError / TokenizerMismatchError / SourceError / CheckpointError included
        print(f"megaflex-eval: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_cli(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``megaflex-eval`` with its arguments; returns the results dict (also printed / written)."""
    from megaflex.eval.loading import load_for_eval, refuse_bidirectional
    from megaflex.eval.plotting import write_json

    args = build_parser().parse_args(argv)
    refuse_bidirectional(args.checkpoint, args.tag, "perplexity")  # before any process group
    state, tracker = _distributed(args.tensor_parallel_size)
    loaded = load_for_eval(args.checkpoint, tag=args.tag, tokenizer=args.tokenizer, device=args.device,
                           parallel=state, rng_tracker=tracker)
    if loaded.tokenizer is not None:  # bits per byte and word counts come from the decoded text
        from megaflex.data.tokenizer import check_lossless

        check_lossless(loaded.tokenizer, "--tokenizer" if args.tokenizer else f"checkpoint {loaded.path}")
    check_eval_tokenizer(loaded.meta.tokenizer, loaded.tokenizer, args.data, str(loaded.path))
    context = args.context if args.context is not None else loaded.model.config.max_seq_len
    contexts = args.contexts
    if contexts and args.mode == "stateful":  # stateful results do not depend on the chunk length
        raise ValueError("--contexts: a context sweep needs --mode windows or sliding; stateful results do not "
                         "depend on --context (their by_context curve, in --json/--plot, is ppl by position)")
    eval_set = load_eval_set(
        args.data, loaded.tokenizer, doc_mode=args.doc_mode, text_key=args.text_key,
        prepend_eod=not args.no_prepend_eod, max_docs=args.max_docs, max_tokens=args.max_tokens,
        encoding_errors=args.encoding_errors, vocab_size=loaded.vocab_size,
    )
    token_bytes = None
    if loaded.tokenizer is not None:
        token_bytes = torch.from_numpy(loaded.tokenizer.piece_byte_lengths)
    dp = dict(rank=0, world_size=1, group=None)
    if state is not None:
        dp = dict(rank=state.dp_rank, world_size=state.dp_size, group=state.dp_group)
    results = run_eval(
        loaded.model, eval_set.docs, args.mode, context, stride=args.stride, contexts=contexts,
        words=eval_set.words, token_bytes=token_bytes, batch_size=args.batch_size, **dp,
    )
    results.update(
        checkpoint=str(loaded.path), iteration=loaded.meta.iteration, data=args.data,
        description=eval_set.description, world_size=state.world_size if state else 1,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if state is None or state.rank == 0:
        print(format_results(args.data, results))
        if args.json:
            write_json(args.json, results)
        if args.plot:
            plot_results(results, args.plot)
    return results


def format_results(data: str, results: dict[str, Any]) -> str:
    """The console lines: the evaluation, then one line per context of the sweep. Bits per byte
    and word perplexity only where they are known (a tokenizer; word counts of the text)."""
    def parts(r: dict[str, Any]) -> str:
        known = [f"ppl {r['ppl']:.3f}", f"tokens {r['tokens']:,}"]
        if r.get("bits_per_byte") is not None:
            known.append(f"bits/byte {r['bits_per_byte']:.4f}")
        if r.get("word_ppl") is not None:
            known.append(f"word ppl {r['word_ppl']:.3f}")
        return " | ".join(known)

    lines = [f"{data}: {parts(results)} | mode {results['mode']} context {results['context']}"]
    for r in results["context_sweep"]:
        stride = "" if r["stride"] is None else f" stride {r['stride']}"
        lines.append(f"  context {r['context']}{stride}: {parts(r)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
