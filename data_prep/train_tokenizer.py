"""Train a lossless tokenizer (sentencepiece BPE/unigram, or a byte-level BPE of the Hugging Face
``tokenizers`` library) from text, JSONL or a HF dataset.

    python -m data_prep.train_tokenizer --input wiki.train.raw --vocab-size 32000 --output-prefix tok/wt103
    python -m data_prep.train_tokenizer --type bpe --input wiki.train.raw --vocab-size 32000 --output-prefix tok/wt103

writes ``tok/wt103.model`` (sentencepiece; ``--type bpe``: ``tok/wt103.json``, a GPT-2-style
byte-level BPE ``tokenizer.json`` with ``<|endoftext|>`` as EOD) and ``tok/wt103.card.json``
(vocab size, special ids, sources with sha256). Both load with ``megaflex.data.Tokenizer``. Losslessness (``decode(encode(t)) == t``) comes from identity normalisation, no dummy
prefix, kept whitespace, byte fallback and ``\\n`` as a user-defined piece (sentencepiece trains
on lines, so newlines would otherwise only be reachable through byte fallback).

Existing outputs are not replaced unless ``--overwrite`` is given.

Large corpora: ``--max-sentences`` caps the training lines by seeded reservoir sampling over the
whole stream (memory O(cap)); the same seed and inputs give the same model bytes.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from megaflex.data.sources import DOC_MODES, fingerprint, iter_corpus
from megaflex.data.tokenizer import TokenizerCard, card_path


TOKENIZER_TYPES = ("sentencepiece", "bpe")
BYTE_ALPHABET = 256
EOD_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<s>", "<pad>"  # byte-level BPE special tokens


@dataclass
class TokenizerTrainConfig:
    inputs: list[str]
    vocab_size: int
    output_prefix: str
    tokenizer_type: str = "sentencepiece"  # "sentencepiece" | "bpe" (byte-level BPE, ``tokenizers`` library)
    model_type: str = "bpe"  # "bpe" | "unigram"
    byte_fallback: bool = True
    bos: bool = True
    pad: bool = True
    user_defined_symbols: list[str] = field(default_factory=list)
    max_sentences: int = 1_000_000  # training-line cap for very large corpora
    max_sentence_length: int = 16384  # bytes; longer lines are cut into pieces of this size
    character_coverage: float = 0.9995
    seed: int = 1234
    num_threads: int = 2
    text_key: str = "text"
    doc_mode: str = "auto"
    encoding_errors: str = "strict"
    overwrite: bool = False  # replace an existing PREFIX.model / PREFIX.card.json

    def __post_init__(self) -> None:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"type: expected one of {TOKENIZER_TYPES}, got {self.tokenizer_type!r}")
        if self.tokenizer_type == "bpe" and self.vocab_size < BYTE_ALPHABET + 3:
            raise ValueError(f"vocab_size: a byte-level BPE needs at least {BYTE_ALPHABET + 3} (256 bytes + special "
                             f"tokens), got {self.vocab_size}")
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type: expected 'bpe' or 'unigram', got {self.model_type!r}")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size: expected at least 8, got {self.vocab_size}")
        if self.max_sentences <= 0:
            raise ValueError(f"max_sentences: expected a positive cap, got {self.max_sentences}")


def training_lines(docs: Iterable[str], max_len: int) -> Iterator[str]:
    """Non-blank lines of every document, long ones cut to ``max_len`` characters."""
    for doc in docs:
        for line in doc.split("\n"):
            if line.strip():
                for i in range(0, len(line), max_len):
                    yield line[i : i + max_len]


def reservoir_sample(items: Iterable[str], k: int, seed: int) -> tuple[list[str], int]:
    """Uniform sample of ``k`` items in stream order (algorithm R) and the stream length."""
    rng = random.Random(seed)
    sample: list[tuple[int, str]] = []
    n = 0
    for n, item in enumerate(items, 1):
        if len(sample) < k:
            sample.append((n, item))
        else:
            j = rng.randrange(n)
            if j < k:
                sample[j] = (n, item)
    sample.sort()  # keep corpus order so the trainer sees the same sequence for the same inputs
    return [s for _, s in sample], n


def train_tokenizer(cfg: TokenizerTrainConfig) -> Path:
    """Train, write ``PREFIX.model`` (``--type bpe``: ``PREFIX.json``) and ``PREFIX.card.json``;
    returns the model path."""
    out = Path(cfg.output_prefix + (".json" if cfg.tokenizer_type == "bpe" else ".model"))
    existing = [str(p) for p in (out, card_path(out)) if p.exists()]
    if existing and not cfg.overwrite:
        raise FileExistsError(f"output-prefix: {', '.join(existing)} already exist; pass --overwrite to replace them")
    docs = iter_corpus(cfg.inputs, cfg.text_key, cfg.doc_mode, cfg.encoding_errors)
    # sentencepiece counts max_sentence_length in bytes; cutting at len/4 characters keeps lines under it
    lines, total = reservoir_sample(training_lines(docs, cfg.max_sentence_length // 4), cfg.max_sentences, cfg.seed)
    if not lines:
        raise ValueError(f"input: no non-blank text lines in {cfg.inputs}")
    train = _train_byte_level_bpe if cfg.tokenizer_type == "bpe" else _train_sentencepiece
    model_bytes, card_fields = train(cfg, lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(model_bytes)
    card = TokenizerCard(seed=cfg.seed, sources=[fingerprint(s) for s in cfg.inputs], num_training_sentences=len(lines),
                         **card_fields)
    card.save(card_path(out))
    print(f"wrote {out} and {card_path(out)}: vocab {card.vocab_size}, {len(lines)} of {total} lines", file=sys.stderr)
    return out


def _train_sentencepiece(cfg: TokenizerTrainConfig, lines: list[str]) -> tuple[bytes, dict]:
    import sentencepiece as spm

    symbols = ["\n"] + [s for s in cfg.user_defined_symbols if s != "\n"]
    special = {"unk_id": 0, "bos_id": 1 if cfg.bos else -1, "eos_id": 2 if cfg.bos else 1}
    special["pad_id"] = (max(special.values()) + 1) if cfg.pad else -1
    model = io.BytesIO()
    spm.set_random_generator_seed(cfg.seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=cfg.vocab_size,
            model_type=cfg.model_type,
            byte_fallback=cfg.byte_fallback,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=False,
            user_defined_symbols=symbols,
            character_coverage=cfg.character_coverage,
            max_sentence_length=cfg.max_sentence_length,
            input_sentence_size=0,  # we sampled already
            shuffle_input_sentence=False,
            num_threads=cfg.num_threads,
            hard_vocab_limit=True,
            minloglevel=2,
            **special,
        )
    except RuntimeError as e:
        raise ValueError(f"vocab_size: sentencepiece could not train {cfg.vocab_size} pieces on {len(lines)} lines: {e}") from None
    return model.getvalue(), dict(vocab_size=cfg.vocab_size, model_type=cfg.model_type, byte_fallback=cfg.byte_fallback,
                                  user_defined_symbols=symbols, **special)


def _train_byte_level_bpe(cfg: TokenizerTrainConfig, lines: list[str]) -> tuple[bytes, dict]:
    """GPT-2-style byte-level BPE (lossless: every byte is a token; no unknown token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [EOD_TOKEN] + ([BOS_TOKEN] if cfg.bos else []) + ([PAD_TOKEN] if cfg.pad else [])
    specials += [s for s in cfg.user_defined_symbols if s not in specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer, length=len(lines))
    ids = {s: tok.token_to_id(s) for s in specials}
    return (tok.to_str(pretty=True) + "\n").encode("utf-8"), dict(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), model_type="bpe", byte_fallback=True,
        user_defined_symbols=specials[1 + cfg.bos + cfg.pad:], unk_id=-1, eos_id=ids[EOD_TOKEN],
        bos_id=ids.get(BOS_TOKEN, -1), pad_id=ids.get(PAD_TOKEN, -1), library="tokenizers")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="text files, .jsonl files, or hf:NAME[:CONFIG[:SPLIT]][:key=value]")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--type", dest="tokenizer_type", choices=TOKENIZER_TYPES, default="sentencepiece",
                    help="sentencepiece (PREFIX.model) or bpe: a byte-level BPE tokenizer.json (PREFIX.json)")
    ap.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece's model type")
    ap.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false")
    ap.add_argument("--no-bos", dest="bos", action="store_false", help="no BOS token")
    ap.add_argument("--no-pad", dest="pad", action="store_false", help="no PAD token")
    ap.add_argument("--user-defined-symbols", nargs="*", default=[])
    ap.add_argument("--max-sentences", type=int, default=1_000_000, help="sample cap on training lines")
    ap.add_argument("--character-coverage", type=float, default=0.9995)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--doc-mode", choices=DOC_MODES, default="auto")
    ap.add_argument("--encoding-errors", choices=["strict", "replace"], default="strict")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model/.json and PREFIX.card.json")
    a = ap.parse_args(argv)
    try:
        cfg = TokenizerTrainConfig(
            inputs=a.input, vocab_size=a.vocab_size, output_prefix=a.output_prefix, tokenizer_type=a.tokenizer_type,
            model_type=a.model_type,
            byte_fallback=a.byte_fallback, bos=a.bos, pad=a.pad, user_defined_symbols=a.user_defined_symbols,
            max_sentences=a.max_sentences, character_coverage=a.character_coverage, seed=a.seed,
            num_threads=a.num_threads, text_key=a.json_key, doc_mode=a.doc_mode, encoding_errors=a.encoding_errors,
            overwrite=a.overwrite,
        )
        train_tokenizer(cfg)
    except (ValueError, FileExistsError) as e:  # SourceError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
