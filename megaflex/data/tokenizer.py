"""One tokenizer interface, two implementations: a sentencepiece ``P.model`` or a Hugging Face
``tokenizers`` file (``tokenizer.json``, e.g. a GPT-2/Llama-style byte-level BPE), each with its
JSON card ``P.card.json``.

``data_prep.train_tokenizer`` writes either (``--type sentencepiece|bpe``); training,
preprocessing, evaluation, generation and export all load them through ``Tokenizer(path)``,
which picks the implementation from the file (a JSON file is a ``tokenizers`` file), so special
ids, byte accounting and the identity record (``record``: sha256 of the file, vocab size) come
from one place. Models trained by ``data_prep`` are lossless: ``decode(encode(text)) == text``
(sentencepiece: identity normalisation, no dummy prefix, byte fallback, ``\\n`` as a piece;
byte-level BPE: every byte is a token).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# end-of-document tokens of common tokenizer.json files without a megaflex card (GPT-2, Llama 3, Llama 2, ...)
KNOWN_EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
MODEL_SUFFIXES = (".model", ".json")
# What a tokenizer must give back byte for byte for bits per byte, word counts and the text of
# indexed data to be right: capitals, a run of spaces, single and double newlines, a leading space,
# digits and punctuation (characters any training corpus has, so models without byte fallback pass).
ROUND_TRIP_PROBE = "The quick brown fox\njumps  over the\n\n lazy dog, 0123456789.\n"


def card_path(model_path: str | os.PathLike) -> Path:
    """``P.model`` / ``P.json`` -> ``P.card.json``."""
    p = Path(model_path)
    for suffix in MODEL_SUFFIXES:
        if p.name.endswith(suffix):
            return p.with_name(p.name[: -len(suffix)] + ".card.json")
    return p.with_name(p.name + ".card.json")


def is_tokenizers_file(model_path: str | os.PathLike) -> bool:
    """A Hugging Face ``tokenizers`` file (JSON) rather than a sentencepiece model (protobuf)."""
    with open(model_path, "rb") as f:
        return f.read(64).lstrip()[:1] == b"{"


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
    library: str = "sentencepiece"  # "sentencepiece" | "tokenizers"

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenizerCard":
        data = json.loads(Path(path).read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class Tokenizer:
    """Encode/decode with the special ids and byte accounting needed for bits-per-byte.

    ``Tokenizer(path)`` returns a ``SentencePieceTokenizer`` or a ``HFTokenizer`` (for a JSON
    ``tokenizers`` file); subclasses provide the library calls, everything else is here."""

    library = ""

    def __new__(cls, model_path: str | os.PathLike | None = None) -> "Tokenizer":
        if cls is Tokenizer and model_path is not None:
            if not os.path.isfile(model_path):
                raise FileNotFoundError(f"model_path: tokenizer model {os.fspath(model_path)} not found")
            cls = HFTokenizer if is_tokenizers_file(model_path) else SentencePieceTokenizer
        return super().__new__(cls)

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"model_path: tokenizer model {self.model_path} not found")
        cp = card_path(self.model_path)
        self.card: TokenizerCard | None = TokenizerCard.load(cp) if cp.is_file() else None
        self._piece_bytes: np.ndarray | None = None
        self._record: dict | None = None

    # ------------------------------------------------------------------ ids (library-specific)
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod_id(self) -> int:
        """End-of-document id appended after every document."""
        raise NotImplementedError

    @property
    def eos_id(self) -> int:
        return self.eod_id

    @property
    def bos_id(self) -> int:
        raise NotImplementedError

    @property
    def pad_id(self) -> int:
        raise NotImplementedError

    @property
    def unk_id(self) -> int:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; control tokens (BOS/EOS/PAD) decode to nothing."""
        raise NotImplementedError

    def id_to_piece(self, idx: int) -> str:
        raise NotImplementedError

    def _piece_byte_length(self, idx: int) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    @property
    def record(self) -> dict:
        """Identity recorded with data and checkpoints: sha256 of the model file, vocab size, path."""
        if self._record is None:
            from megaflex.data.card import tokenizer_record

            self._record = tokenizer_record(self.model_path, self.vocab_size)
        return self._record

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @property
    def piece_byte_lengths(self) -> np.ndarray:
        """int64[vocab_size]: UTF-8 bytes each token contributes to decoded text (0 for control
        tokens, 1 for byte pieces), so ``piece_byte_lengths[ids].sum()`` is the byte length of
        ``decode(ids)`` for lossless models — the denominator of bits-per-byte."""
        if self._piece_bytes is None:
            self._piece_bytes = np.array([self._piece_byte_length(i) for i in range(self.vocab_size)], np.int64)
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

    def lossless_problem(self, text: str = ROUND_TRIP_PROBE) -> str | None:
        """Why this tokenizer is not lossless on ``text`` (None when ``decode(encode(text)) == text``
        and its pieces count the text's UTF-8 bytes exactly, what bits per byte divides by)."""
        ids = self.encode(text)
        back = self.decode(ids)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            start = max(0, at - 8)
            return f"decode(encode(text)) changes {text[start:at + 8]!r} into {back[start:at + 8]!r}"
        counted = sum(self._piece_byte_length(int(i)) for i in ids)
        if counted != len(text.encode("utf-8")):
            return f"its pieces count {counted} bytes for a text of {len(text.encode('utf-8'))}"
        return None

    def __getnewargs__(self) -> tuple:
        return (self.model_path,)

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``P.model``."""

    library = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm  # deferred: only tokenizing code needs it

        super().__init__(model_path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto" names no file
            raise ValueError(
                f"model_path: {self.model_path} is not a sentencepiece model ({str(e).strip()}); "
                f"pass the P.model (or tokenizer.json) written by data_prep.train_tokenizer"
            ) from None

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod_id(self) -> int:
        return int(self._sp.eos_id())  # sentencepiece's EOS

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts; one thread by default so process-level parallelism stays predictable."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode(np.asarray(ids, dtype=np.int64).tolist())

    def id_to_piece(self, idx: int) -> str:
        return self._sp.id_to_piece(int(idx))

    def _piece_byte_length(self, idx: int) -> int:
        if self._sp.is_control(idx) or self._sp.is_unknown(idx):
            return 0
        if self._sp.is_byte(idx):
            return 1
        return len(self._sp.id_to_piece(idx).replace("\u2581", " ").encode("utf-8"))


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``). Special ids come from the card when
    there is one, else from the file's special tokens (EOD: the first of ``KNOWN_EOD_TOKENS``)."""

    library = "tokenizers"

    def __init__(self, model_path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as _BackendTokenizer  # deferred: only tokenizing code needs it

        super().__init__(model_path)
        try:
            self._tok = _BackendTokenizer.from_file(self.model_path)
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"model_path: {self.model_path} is not a tokenizers file ({str(e).strip()[:200]}); "
                             f"pass a tokenizer.json (or the P.model of a sentencepiece tokenizer)") from None
        self._specials: dict[str, int] = {}
        for added in json.loads(Path(self.model_path).read_text(encoding="utf-8")).get("added_tokens", []):
            if added.get("special"):
                self._specials[added["content"]] = int(added["id"])
        self._special_ids = set(self._specials.values())
        self._added_ids = set(self._tok.get_added_tokens_decoder())
        self._byte_level = _is_byte_level(self._tok)
        self._eod = self._special_id("eos_id", KNOWN_EOD_TOKENS)
        if self._eod < 0:
            raise ValueError(f"model_path: {self.model_path} names no end-of-document token (none of "
                             f"{', '.join(KNOWN_EOD_TOKENS)}, and no card {card_path(self.model_path)} with eos_id)")

    def _special_id(self, card_field: str, names: Sequence[str]) -> int:
        if self.card is not None:
            return int(getattr(self.card, card_field))
        return next((self._specials[n] for n in names if n in self._specials), -1)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def bos_id(self) -> int:
        return self._special_id("bos_id", ("<|begin_of_text|>", "<s>", "<bos>"))

    @property
    def pad_id(self) -> int:
        return self._special_id("pad_id", ("<pad>", "<|pad|>"))

    @property
    def unk_id(self) -> int:
        return self._special_id("unk_id", ("<unk>",))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts, no special tokens added (``tokenizers`` parallelises internally)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=True)

    def id_to_piece(self, idx: int) -> str:
        return self._tok.id_to_token(int(idx))

    def _piece_byte_length(self, idx: int) -> int:
        piece = self._tok.id_to_token(idx)
        if piece is None or idx in self._special_ids:
            return 0
        if self._byte_level and idx not in self._added_ids:
            return len(piece)  # one character of the byte alphabet per byte
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return 1  # a byte-fallback piece (Llama-2 style)
        return len(piece.replace("\u2581", " ").encode("utf-8"))


def _is_byte_level(tok: Any) -> bool:
    """True when the decoder maps pieces back through the GPT-2 byte alphabet."""
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def check_lossless(tokenizer: Tokenizer, setting: str) -> None:
    """DataError (naming ``setting``) when ``tokenizer`` is lossy (``Tokenizer.lossless_problem``):
    a model scored with it would report bits per byte and word perplexity of another text."""
    from megaflex.data.indexed import DataError

    problem = tokenizer.lossless_problem()
    if problem is not None:
        raise DataError(f"{setting}: tokenizer {tokenizer.model_path} is lossy: {problem}; bits per byte and word "
                        "counts would measure another text: use a lossless tokenizer (data_prep.train_tokenizer "
                        "writes one: byte fallback, identity normalisation)")
