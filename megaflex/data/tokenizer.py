"""Thin, picklable wrapper around a trained sentencepiece model and its JSON card.

``data_prep.train_tokenizer`` writes ``P.model`` and ``P.card.json``; training, preprocessing and
evaluation all load them through :class:`Tokenizer` so special ids come from one place.
Models trained by ``data_prep`` are lossless (identity normalisation, no dummy prefix, byte
fallback, ``\\n`` as a piece): ``decode(encode(text)) == text`` for any text.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np


def card_path(model_path: str | os.PathLike) -> Path:
    """``P.model`` -> ``P.card.json``."""
    p = Path(model_path)
    return p.with_name(p.name[: -len(".model")] + ".card.json") if p.name.endswith(".model") else p.with_name(p.name + ".card.json")


@dataclass
class TokenizerCard:
    """Metadata written next to a tokenizer model."""

    vocab_size: int
    model_type: str
    unk_id: int
    bos_id: int  # -1 when disabled
    eos_id: int  # also the end-of-document (EOD) token appended by preprocessing
    pad_id: int  # -1 when disabled
    byte_fallback: bool = True
    user_defined_symbols: list[str] = field(default_factory=list)
    seed: int = 0
    sources: list[dict] = field(default_factory=list)  # {"source": ..., "sha256": ...}
    num_training_sentences: int = 0

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenizerCard":
        data = json.loads(Path(path).read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class Tokenizer:
    """Encode/decode with the special ids and byte accounting needed for bits-per-byte."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm  # deferred: only tokenizing code needs it

        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"model_path: tokenizer model {self.model_path} not found")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto" names no file
            raise ValueError(
                f"model_path: {self.model_path} is not a sentencepiece model ({str(e).strip()}); "
                f"pass the P.model written by data_prep.train_tokenizer"
            ) from None
        cp = card_path(self.model_path)
        self.card: TokenizerCard | None = TokenizerCard.load(cp) if cp.is_file() else None
        self._piece_bytes: np.ndarray | None = None
        self._record: dict | None = None

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod_id(self) -> int:
        """End-of-document id appended after every document (sentencepiece's EOS)."""
        return int(self._sp.eos_id())

    eos_id = eod_id

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id())

    @property
    def record(self) -> dict:
        """Identity recorded with data and checkpoints: sha256 of the model file, vocab size, path."""
        if self._record is None:
            from megaflex.data.card import tokenizer_record

            self._record = tokenizer_record(self.model_path, self.vocab_size)
        return self._record

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts; one thread by default so process-level parallelism stays predictable."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; control tokens (BOS/EOS/PAD) decode to nothing."""
        return self._sp.decode(np.asarray(ids, dtype=np.int64).tolist())

    def id_to_piece(self, idx: int) -> str:
        return self._sp.id_to_piece(int(idx))

    # ------------------------------------------------------------------ bytes per token
    @property
    def piece_byte_lengths(self) -> np.ndarray:
        """int64[vocab_size]: UTF-8 bytes each token contributes to decoded text (0 for control
        tokens, 1 for byte-fallback pieces), so ``piece_byte_lengths[ids].sum()`` is the byte
        length of ``decode(ids)`` for lossless models — the denominator of bits-per-byte."""
        if self._piece_bytes is None:
            lengths = np.zeros(self.vocab_size, np.int64)
            for i in range(self.vocab_size):
                if self._sp.is_control(i) or self._sp.is_unknown(i):
                    continue
                if self._sp.is_byte(i):
                    lengths[i] = 1
                else:
                    lengths[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
            self._piece_bytes = lengths
        return self._piece_bytes

    def num_bytes(self, ids: Sequence[int] | np.ndarray) -> int:
        """UTF-8 byte length of the text ``ids`` decode to."""
        return int(self.piece_byte_lengths[np.asarray(ids, dtype=np.int64)].sum())

    @staticmethod
    def bits_per_byte(total_nll_nats: float, total_bytes: int) -> float:
        """Convert a summed token negative log-likelihood (nats) into bits per UTF-8 byte."""
        if total_bytes <= 0:
            raise ValueError(f"total_bytes: expected a positive byte count, got {total_bytes}")
        return total_nll_nats / (math.log(2) * total_bytes)

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"
