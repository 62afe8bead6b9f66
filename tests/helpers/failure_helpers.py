"""What every user error of a megaflex command looks like: exactly one ``PROG: ... error: ...``
line on stderr and no traceback (progress bars and warnings may surround it); and bad inputs
shared by the failure tests (tokenizer files megaflex does not accept)."""

from __future__ import annotations

from pathlib import Path


def one_error_line(stderr: str, prog: str) -> str:
    """The single error line of ``prog`` in ``stderr`` (asserting there is one and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, f"expected one error line, got {errors}:\n{stderr[-3000:]}"
    assert errors[0].startswith(f"{prog}: ") and "error: " in errors[0], errors[0]
    return errors[0]


def foreign_tokenizer_file(path: Path, kind: str, text: str) -> Path:
    """A ``tokenizers`` file megaflex's data_prep never writes: "wordpiece" (BERT-style, lowercasing,
    no end-of-document token) or "unigram" (a normalizer that turns newlines into spaces), trained
    on ``text``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from megaflex.data.tokenizer import ROUND_TRIP_PROBE

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[SEP]", "[PAD]"])
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Replace("\n", " ")
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], unk_token="<unk>")
    tok.train_from_iterator([text, ROUND_TRIP_PROBE], trainer)  # every probe character is in the vocabulary
    tok.save(str(path))
    return path
