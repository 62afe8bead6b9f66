"""Tokenizer training, source reading and preprocessing: lossless round trips on real text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the hf: path must work without a network

from data_prep.preprocess import PreprocessConfig, preprocess
from megaflex.data.sources import SourceError, is_wikitext_title, iter_corpus, iter_documents, parse_spec
from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer
from megaflex.data.indexed import IndexedDataset
from megaflex.data.tokenizer import Tokenizer, card_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(shared_data: Path, tmp_path_factory) -> Tokenizer:
    """One small BPE tokenizer on WikiText-2 valid + english-docs valid (trains in about a second)."""
    out = tmp_path_factory.mktemp("tok") / "bpe"
    cfg = TokenizerTrainConfig(
        inputs=[str(shared_data / "wikitext-2-raw/wiki.valid.raw"), str(shared_data / "english-docs/valid.jsonl")],
        vocab_size=3000, output_prefix=str(out), max_sentences=20000,
    )
    return Tokenizer(train_tokenizer(cfg))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


def assert_round_trip(tok: Tokenizer, prefix: str, docs: list[str]) -> None:
    ds = IndexedDataset(prefix, verify=True)
    assert len(ds) == len(docs)
    for i, doc in enumerate(docs):
        ids = ds[i]
        assert ids[-1] == tok.eod_id
        assert tok.decode(ids[:-1]) == doc, f"document {i} differs after decode"
        assert tok.num_bytes(ids) == len(doc.encode("utf-8"))


# ---------------------------------------------------------------------------- sources
def test_wikitext_articles(shared_data: Path) -> None:
    path = shared_data / "wikitext-2-raw/wiki.valid.raw"
    docs = list(iter_documents(str(path)))
    text = path.read_text(encoding="utf-8")
    assert "".join(docs) == text  # lossless: articles concatenate back to the file
    titles = [l for l in text.split("\n") if is_wikitext_title(l)]
    assert len(docs) == len(titles) == 60  # WikiText-2 valid has 60 articles
    for d in docs:
        first = next(l for l in d.split("\n") if l.strip())
        assert is_wikitext_title(first)
        assert sum(is_wikitext_title(l) for l in d.split("\n")) == 1  # sections stay inside
    assert any(" = = " in d for d in docs)
    assert is_wikitext_title(" = Homarus gammarus = ") and not is_wikitext_title(" = = Description = = ")


def test_doc_modes(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_text("a b\n\n c\nd  \n\n\ne\n")
    assert list(iter_documents(str(p))) == ["a b", " c", "d  ", "e"]
    assert list(iter_documents(str(p), doc_mode="paragraph")) == ["a b", " c\nd  ", "e"]
    assert list(iter_documents(str(p), doc_mode="file")) == ["a b\n\n c\nd  \n\n\ne\n"]


def test_hf_sources_match_local_files(shared_data: Path, tmp_path: Path) -> None:
    raw = shared_data / "wikitext-2-raw/wiki.valid.raw"
    jsonl = shared_data / "english-docs/valid.jsonl"
    cache = f"cache_dir={tmp_path / 'hf'}"
    # hf:text rows are lines without "\n": the article splitter (auto-detected) restores them
    hf_wiki = list(iter_documents(f"hf:text:{cache}:data_files={raw}"))
    assert hf_wiki == list(iter_documents(str(raw)))
    assert list(iter_documents(f"hf:text:{cache}:data_files={raw}:streaming=true")) == hf_wiki
    spec = parse_spec(f"hf:json::validation:data_files={jsonl}:{cache}")
    assert spec.hf_name == "json" and spec.hf_config is None and spec.hf_kwargs["split"] == "validation"
    hf_json = list(iter_documents(f"hf:json:{cache}:data_files={jsonl}"))
    assert hf_json == list(iter_documents(str(jsonl)))
    assert len(hf_json) == 326


def test_hf_wikitext_style_rows(tmp_path: Path) -> None:
    """HF's wikitext rows keep their "\\n" and blank lines are ""; both become lines again."""
    rows = ["", " = A = \n", "", " x \n", " = = S = = \n", " y \n", "", " = B = \n", " z \n"]
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    docs = list(iter_documents(f"hf:json:data_files={p}:cache_dir={tmp_path / 'hf'}"))
    assert docs == ["\n = A = \n\n x \n = = S = = \n y \n\n", " = B = \n z \n"]


def test_non_utf8_input(tmp_path: Path) -> None:
    p = tmp_path / "bad.txt"
    p.write_bytes(b"fine\nalso fine\nbroken \xff byte\n")
    with pytest.raises(SourceError, match=r"bad\.txt:3: invalid UTF-8 byte 0xff"):
        list(iter_documents(str(p)))
    assert list(iter_documents(str(p), errors="replace"))[2] == "broken \ufffd byte"
    j = tmp_path / "bad.jsonl"
    j.write_bytes(b'{"text": "ok"}\n{"text": "\xc3("}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl:2: invalid UTF-8"):
        list(iter_documents(str(j)))


def test_hf_input_without_the_datasets_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed (a GPU node's offline install)
    with pytest.raises(SourceError, match=r"input hf:wikitext:.*the datasets package is not installed; pip install 'megaflex\[tools\]'"):
        list(iter_documents("hf:wikitext:wikitext-2-raw-v1:train"))


def test_bad_jsonl_and_missing_and_empty(tmp_path: Path) -> None:
    j = tmp_path / "x.jsonl"
    j.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(SourceError, match=r"x\.jsonl:2: no 'text' key"):
        list(iter_documents(str(j)))
    with pytest.raises(SourceError, match=r"x\.jsonl:1: no 'body' key"):
        list(iter_documents(str(j), text_key="body"))
    j.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(SourceError, match=r"x\.jsonl:2: invalid JSON"):
        list(iter_documents(str(j)))
    with pytest.raises(SourceError, match=r"missing\.txt: input file not found"):
        list(iter_corpus([str(tmp_path / "missing.txt")]))
    e = tmp_path / "empty.txt"
    e.write_text("\n   \n\n")
    with pytest.raises(SourceError, match="empty corpus"):
        list(iter_corpus([str(e)]))


# ---------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_tokenizer_deterministic_and_card(shared_data: Path, tmp_path: Path, model_type: str) -> None:
    inputs = [str(shared_data / "wikitext-2-raw/wiki.test.raw")]
    paths = []
    for run in ("a", "b"):
        cfg = TokenizerTrainConfig(inputs=inputs, vocab_size=400, output_prefix=str(tmp_path / run),
                                   model_type=model_type, max_sentences=600, seed=7)
        paths.append(train_tokenizer(cfg))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    card = json.loads(card_path(paths[0]).read_text())
    assert card["vocab_size"] == 400 and card["model_type"] == model_type
    assert (card["unk_id"], card["bos_id"], card["eos_id"], card["pad_id"]) == (0, 1, 2, 3)
    import hashlib

    assert card["sources"][0]["sha256"] == hashlib.sha256(Path(inputs[0]).read_bytes()).hexdigest()
    assert card["num_training_sentences"] == 600  # the sample cap applied (the file has 2,891 lines)
    t = Tokenizer(paths[0])
    assert (t.vocab_size, t.eod_id, t.bos_id, t.pad_id) == (400, 2, 1, 3)
    tricky = " lead\n\n  two  spaces\ttab é 漢字 🙂 \n"
    assert t.decode(t.encode(tricky)) == tricky  # byte fallback + identity normalisation
    assert t.num_bytes(t.encode(tricky)) == len(tricky.encode())


def test_tokenizer_options(tmp_path: Path) -> None:
    src = tmp_path / "s.txt"
    src.write_text("".join(f"line {i} of some text with words\n" for i in range(300)))
    cfg = TokenizerTrainConfig(inputs=[str(src)], vocab_size=300, output_prefix=str(tmp_path / "t"),
                               bos=False, pad=False, user_defined_symbols=["<sep>"])
    t = Tokenizer(train_tokenizer(cfg))
    assert (t.bos_id, t.eod_id, t.pad_id) == (-1, 1, -1)
    assert t.id_to_piece(t.encode("a<sep>b")[1]) == "<sep>"


# ---------------------------------------------------------------------------- preprocessing
def test_round_trip_wikitext(tok: Tokenizer, shared_data: Path, tmp_path: Path) -> None:
    inputs = [str(shared_data / f"wikitext-2-raw/wiki.{s}.raw") for s in ("valid", "test")]
    stats = preprocess(PreprocessConfig(inputs, tok.model_path, str(tmp_path / "wt"), progress=False))
    docs = list(iter_corpus(inputs))
    titles = sum(is_wikitext_title(l) for p in inputs for l in Path(p).read_text(encoding="utf-8").split("\n"))
    assert stats["documents"] == len(docs) == titles == 60 + 62
    assert stats["dtype"] == "uint16"
    assert_round_trip(tok, str(tmp_path / "wt"), docs)


@pytest.mark.slow
def test_round_trip_english_docs(tok: Tokenizer, shared_data: Path, tmp_path: Path) -> None:
    """Every one of the 6,623 documents (62 MB) survives text -> tokens -> .bin/.idx -> text."""
    inputs = [str(shared_data / f"english-docs/{f}.jsonl") for f in ("train-00", "train-01", "valid")]
    preprocess(PreprocessConfig(inputs, tok.model_path, str(tmp_path / "en"), num_proc=2, progress=False))
    docs = list(iter_corpus(inputs))
    assert len(docs) == 6623
    assert_round_trip(tok, str(tmp_path / "en"), docs)


def test_num_proc_and_shards_give_identical_tokens(tok: Tokenizer, shared_data: Path, tmp_path: Path) -> None:
    inputs = [str(shared_data / "english-docs/valid.jsonl")]
    preprocess(PreprocessConfig(inputs, tok.model_path, str(tmp_path / "one"), progress=False))
    preprocess(PreprocessConfig(inputs, tok.model_path, str(tmp_path / "two"), num_proc=2,
                                batch_chars=50_000, progress=False))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"one.{ext}").read_bytes() == (tmp_path / f"two.{ext}").read_bytes()
    stats = preprocess(PreprocessConfig(inputs, tok.model_path, str(tmp_path / "sh"), docs_per_shard=100,
                                        batch_chars=50_000, progress=False))
    assert [Path(p).name for p in stats["prefixes"]] == [f"sh_{i:05d}" for i in range(4)]
    r = run_cli("data_prep.merge", "--input", *stats["prefixes"], "--output-prefix", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    for ext in ("bin", "idx"):
        assert (tmp_path / f"one.{ext}").read_bytes() == (tmp_path / f"merged.{ext}").read_bytes()


def test_preprocess_streams_with_bounded_read_ahead(tok: Tokenizer, monkeypatch, tmp_path: Path) -> None:
    """Workers never hold more than 2*num_proc batches: the reader is only that far ahead."""
    import data_prep.preprocess as pp

    pulled = []

    def endless_corpus(*args, **kwargs):
        for i in range(10**9):  # far more text than RAM; only a bounded prefix may be read
            pulled.append(i)
            yield f"document {i} with a few words\n"

    monkeypatch.setattr(pp, "iter_corpus", endless_corpus)
    cfg = PreprocessConfig(["unused"], tok.model_path, str(tmp_path / "o"), num_proc=2, batch_chars=300)
    batches = pp._encoded_batches(cfg)
    docs_per_batch = 300 // len("document 0 with a few words\n") + 1
    for k in range(1, 6):
        flat, lengths, _ = next(batches)
        assert len(lengths) == docs_per_batch
        assert len(pulled) <= (k + 2 * cfg.num_proc) * docs_per_batch  # read-ahead stays bounded
    batches.close()


def test_preprocess_errors(tok: Tokenizer, tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("hello world\n")
    with pytest.raises(ValueError, match="3000 tokens does not fit uint8"):
        preprocess(PreprocessConfig([str(src)], tok.model_path, str(tmp_path / "o"), dtype="uint8", progress=False))
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"ok\n\xfe\n")
    with pytest.raises(SourceError, match=r"b\.txt:2: invalid UTF-8"):
        preprocess(PreprocessConfig([str(bad)], tok.model_path, str(tmp_path / "o"), progress=False))
    assert not list(tmp_path.glob("o.*"))  # nothing half-written
    stats = preprocess(PreprocessConfig([str(bad)], tok.model_path, str(tmp_path / "o"),
                                        encoding_errors="replace", progress=False))
    assert tok.decode(IndexedDataset(tmp_path / "o")[1][:-1]) == "\ufffd"
    assert stats["documents"] == 2


def test_cli_contract(shared_data: Path, tmp_path: Path) -> None:
    raw = str(shared_data / "wikitext-2-raw/wiki.valid.raw")
    r = run_cli("data_prep.train_tokenizer", "--input", raw, "--vocab-size", "800",
                "--output-prefix", str(tmp_path / "tk"), "--max-sentences", "2000", "--model-type", "unigram")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tk.model").is_file() and (tmp_path / "tk.card.json").is_file()
    r = run_cli("data_prep.preprocess", "--input", f"hf:text:data_files={raw}:cache_dir={tmp_path / 'hf'}",
                "--tokenizer", str(tmp_path / "tk.model"), "--output-prefix", str(tmp_path / "wt"),
                "--num-proc", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    r = run_cli("data_prep.inspect", str(tmp_path / "wt"), "--verify", "--tokenizer", str(tmp_path / "tk.model"))
    assert r.returncode == 0, r.stderr
    assert "60 documents" in r.stdout and "Homarus" in r.stdout
    r = run_cli("data_prep.preprocess", "--input", str(tmp_path / "missing.txt"), "--tokenizer",
                str(tmp_path / "tk.model"), "--output-prefix", str(tmp_path / "x"))
    assert r.returncode == 2 and "missing.txt: input file not found" in r.stderr
    # token ids beyond the tokenizer's vocabulary are an inconsistency for inspect --verify
    r = run_cli("data_prep.train_tokenizer", "--input", raw, "--vocab-size", "400",
                "--output-prefix", str(tmp_path / "small"), "--max-sentences", "500", "--character-coverage", "0.98")
    assert r.returncode == 0, r.stderr
    r = run_cli("data_prep.inspect", str(tmp_path / "wt"), "--verify", "--tokenizer", str(tmp_path / "small.model"))
    assert r.returncode == 1 and ">= vocab size 400" in r.stderr
