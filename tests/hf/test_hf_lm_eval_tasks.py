"""megaflex.hf.lm_eval_tasks.split_document: line-aligned pieces that each fit one lm-eval window."""

from __future__ import annotations

import pytest

from megaflex.hf.lm_eval_tasks import split_document


def chars(text: str) -> list[int]:  # a character-level tokenizer: one token per character
    return [ord(c) for c in text]


def test_pieces_cover_the_text_at_line_ends_within_the_budget(shared_data) -> None:
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:40_000]
    pieces = split_document(text, chars, 700)
    assert all(len(p) <= 700 for p in pieces)
    dropped = text
    for p in pieces:  # in order, nothing but whitespace-only pieces left out
        start = dropped.index(p)
        assert not dropped[:start].strip()
        dropped = dropped[start + len(p):]
    assert not dropped.strip()
    # every cut is at a line end or just before a space (a token boundary for megaflex tokenizers)
    assert all(a.endswith("\n") or b.startswith(" ") for a, b in zip(pieces, pieces[1:]))
    assert any(not a.endswith("\n") for a in pieces[:-1]) and len(pieces) > 40  # both kinds of cut happen


def test_long_lines_are_cut_before_spaces_and_overlong_words_fail() -> None:
    line = " ".join(f"w{i:03d}" for i in range(50)) + "\n"  # 250 characters on one line
    pieces = split_document(line, chars, 32)
    assert "".join(pieces) == line and all(len(p) <= 32 for p in pieces)
    assert all(p.startswith(" ") for p in pieces[1:])  # cut before a space
    with pytest.raises(ValueError, match="single word of 40 tokens exceeds 32"):
        split_document("x" * 40, chars, 32)
