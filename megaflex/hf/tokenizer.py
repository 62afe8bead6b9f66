"""A megaflex tokenizer (sentencepiece ``P.model`` or ``tokenizers`` file) as a ``transformers``
fast tokenizer (offline, exact).

Sentencepiece: transformers' own converter (``SpmConverter.build_tokenizer_from_spm_proto``)
follows the model's normaliser spec, so the ``tokenizers`` pipeline encodes exactly like
``SentencePieceProcessor`` for megaflex's lossless models (identity normalisation, no dummy
prefix, byte fallback, ``\\n`` as a piece). A ``tokenizers`` file (``tokenizer.json``, e.g. the
byte-level BPE of ``data_prep.train_tokenizer --type bpe``) is the pipeline already. Tests check
ids on real WikiText text.

Special tokens: megaflex separates documents with EOD and evaluates text as ``[EOD] + tokens``;
so EOD is both ``eos_token`` and ``bos_token`` here. lm-evaluation-harness uses ``bos_token_id``
as the context of a document's first token, which makes its rolling log-likelihood score the
same targets with the same context as ``megaflex-eval``. No special token is added by
``encode`` (``add_bos_token`` is off), as in megaflex.

The original tokenizer file (and its card) is copied beside the HF files (``ORIGINAL_FILES``),
so the way back (``megaflex-export --from-hf``) keeps the tokenizer's identity (sha256).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

from megaflex.data.tokenizer import SentencePieceTokenizer, Tokenizer, card_path

# the original tokenizer file kept in an export, per library ("tokenizer.json" is transformers' own)
ORIGINAL_FILES = {"sentencepiece": "tokenizer.model", "tokenizers": "megaflex_tokenizer.json"}
SP_MODEL_FILE = ORIGINAL_FILES["sentencepiece"]


def hf_tokenizer(model_path: str | os.PathLike, model_max_length: int) -> PreTrainedTokenizerFast:
    """``PreTrainedTokenizerFast`` equivalent to megaflex's ``Tokenizer(model_path)``."""
    megaflex_tok = Tokenizer(model_path)  # FileNotFoundError naming the path when missing
    if isinstance(megaflex_tok, SentencePieceTokenizer):
        proto = SentencePieceExtractor(os.fspath(model_path)).proto
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, None, legacy=False)
    else:
        from tokenizers import Tokenizer as BackendTokenizer

        backend = BackendTokenizer.from_file(os.fspath(model_path))
    piece = megaflex_tok.id_to_piece
    eod = piece(megaflex_tok.eod_id)
    specials = {"bos_token": eod, "eos_token": eod}
    if megaflex_tok.unk_id >= 0:
        specials["unk_token"] = piece(megaflex_tok.unk_id)
    specials["pad_token"] = piece(megaflex_tok.pad_id) if megaflex_tok.pad_id >= 0 else eod
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, padding_side="right",
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False, **specials,
    )


def save_tokenizer(model_path: str | os.PathLike, out_dir: str | os.PathLike, model_max_length: int) -> PreTrainedTokenizerFast:
    """Write the HF tokenizer files plus the original tokenizer file (and its card) into ``out_dir``."""
    tok = hf_tokenizer(model_path, model_max_length)
    tok.save_pretrained(out_dir)
    original = Path(out_dir) / ORIGINAL_FILES[Tokenizer(model_path).library]
    shutil.copyfile(model_path, original)
    card = card_path(model_path)
    if card.is_file():
        shutil.copyfile(card, card_path(original))
    return tok


def original_tokenizer_file(hf_dir: str | os.PathLike) -> Path | None:
    """The megaflex tokenizer file kept in an export directory (None when there is none)."""
    for name in ORIGINAL_FILES.values():
        if (Path(hf_dir) / name).is_file():
            return Path(hf_dir) / name
    return None
