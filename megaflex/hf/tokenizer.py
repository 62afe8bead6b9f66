"""A megaflex sentencepiece model as a ``transformers`` fast tokenizer (offline, exact).

transformers' own sentencepiece converter (``SpmConverter.build_tokenizer_from_spm_proto``)
follows the model's normaliser spec, so the ``tokenizers`` pipeline encodes exactly like
``SentencePieceProcessor`` for megaflex's lossless models (identity normalisation, no dummy
prefix, byte fallback, ``\\n`` as a piece); tests check ids on real WikiText text.

Special tokens: megaflex separates documents with EOD (sentencepiece's EOS) and evaluates text
as ``[EOD] + tokens``; so EOD is both ``eos_token`` and ``bos_token`` here. lm-evaluation-harness
uses ``bos_token_id`` as the context of a document's first token, which makes its rolling
log-likelihood score the same targets with the same context as ``megaflex-eval``.
No special token is added by ``encode`` (``add_bos_token`` is off), as in megaflex.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

from megaflex.data.tokenizer import Tokenizer, card_path

SP_MODEL_FILE = "tokenizer.model"  # the original sentencepiece model, kept for the way back
SP_CARD_FILE = "tokenizer.card.json"


def hf_tokenizer_from_sentencepiece(model_path: str | os.PathLike, model_max_length: int) -> PreTrainedTokenizerFast:
    """``PreTrainedTokenizerFast`` equivalent to megaflex's ``Tokenizer(model_path)``."""
    megaflex_tok = Tokenizer(model_path)  # FileNotFoundError naming the path when missing
    proto = SentencePieceExtractor(os.fspath(model_path)).proto
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, None, legacy=False)
    piece = megaflex_tok._sp.id_to_piece
    eod = piece(megaflex_tok.eod_id)
    specials = {"bos_token": eod, "eos_token": eod}
    unk_id = int(megaflex_tok._sp.unk_id())
    if unk_id >= 0:
        specials["unk_token"] = piece(unk_id)
    pad_id = int(megaflex_tok._sp.pad_id())
    specials["pad_token"] = piece(pad_id) if pad_id >= 0 else eod
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, padding_side="right",
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False, **specials,
    )


def save_tokenizer(model_path: str | os.PathLike, out_dir: str | os.PathLike, model_max_length: int) -> PreTrainedTokenizerFast:
    """Write the HF tokenizer files plus the original ``.model`` (and its card) into ``out_dir``."""
    tok = hf_tokenizer_from_sentencepiece(model_path, model_max_length)
    tok.save_pretrained(out_dir)
    shutil.copyfile(model_path, Path(out_dir) / SP_MODEL_FILE)
    card = card_path(model_path)
    if card.is_file():
        shutil.copyfile(card, Path(out_dir) / SP_CARD_FILE)
    return tok
