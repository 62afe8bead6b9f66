"""Bad data, tokenizers and configs (issue 13, items 2, 3, 9): each is a clear error, or is repaired.

Fast, single-process tests of the library and CLI layer; tests/training/test_training_data_faults.py runs
the same faults through real training, evaluation and generation runs.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from data_prep.preprocess import PreprocessConfig, preprocess
from megaflex.data.sources import SourceError, iter_documents
from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer
from megaflex.eval.eval_data import check_eval_tokenizer, load_eval_set
from megaflex.eval.perplexity import build_parser
from megaflex.data import (
    DataError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    Tokenizer,
    TokenizerMismatchError,
    build_datasets,
    read_data_card,
)
from megaflex.data.indexed import HEADER_SIZE
from megaflex.hashing import sha256_file
from megaflex.training import data as training_data
from megaflex.training.config import ConfigError, load_config
from data_files import shift_pointers, write_docs
from training_harness import REPO, TINY

TEXT = "".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog number {i * 13 % 101}\n" for i in range(400))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different small tokenizers (same vocabulary size, different models) and a text file."""
    root = tmp_path_factory.mktemp("toks")
    (root / "a.txt").write_text(TEXT)
    (root / "b.txt").write_text(TEXT.upper())
    out = {"text": root / "a.txt"}
    for name in ("a", "b"):
        out[name] = train_tokenizer(TokenizerTrainConfig(inputs=[str(root / f"{name}.txt")], vocab_size=300,
                                                         output_prefix=str(root / f"tok_{name}")))
    return out


def tiny_cfg(tmp_path: Path, **data: object):
    cfg = copy.deepcopy(TINY)
    cfg["model"]["vocab_size"] = 512  # > the 300-token test tokenizers
    cfg["data"] = {"source": "indexed", "seq_len": 16, **data}
    cfg["logging"] = {**cfg["logging"], "run_dir": str(tmp_path / "run")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config([path])


# ---------------------------------------------------------------------------- item 2: structure
@pytest.mark.parametrize("shift,which", [(-2, slice(1, None)), (-2, slice(None)), (2, slice(None, -1))],
                         ids=["all-but-first-minus-2", "all-minus-2", "all-but-last-plus-2"])
def test_shifted_pointers_fail_when_opened_for_training(tmp_path: Path, shift: int, which: slice) -> None:
    """Fails on the old code: build_datasets opened without verify, so these indices trained on shifted bytes."""
    write_docs(tmp_path / "d", 40, vocab=250)
    shift_pointers(tmp_path / "d", shift, which)
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: \d+ sequence pointers disagree with the sequence sizes"):
        build_datasets([str(tmp_path / "d")], split="1,0,0", seq_len=8, num_samples_per_split=(10, 0, 0))
    r = run_cli("data_prep.inspect", str(tmp_path / "d"), "--verify")  # the full check agrees
    assert r.returncode == 1 and "pointers disagree" in r.stderr


def test_structural_checks_pass_on_good_data_and_check_the_end_of_the_bin(tmp_path: Path) -> None:
    ds = write_docs(tmp_path / "d", 40, vocab=250)
    ds.verify()
    ds.check_token_sample(250)
    # a last pointer that leaves a gap before the end of the .bin is caught (all others consistent)
    shift_pointers(tmp_path / "d", -2, slice(-1, None))
    with pytest.raises(IndexedDatasetError, match="pointers disagree"):
        IndexedDataset(tmp_path / "d", verify=True)


def test_token_ids_beyond_the_vocabulary_fail_on_open(tmp_path: Path) -> None:
    """Fails on the old code: nothing compared the data's ids with model.vocab_size before the embedding did."""
    write_docs(tmp_path / "d", 30, vocab=1000)
    with pytest.raises(IndexedDatasetError, match=r"d\.bin: sequence \d+ holds token id \d+, outside the vocabulary \[0, 256\)"):
        build_datasets([str(tmp_path / "d")], split="1,0,0", seq_len=8, num_samples_per_split=(10, 0, 0), vocab_size=256)
    build_datasets([str(tmp_path / "d")], split="1,0,0", seq_len=8, num_samples_per_split=(10, 0, 0), vocab_size=1000)


def test_every_training_sample_is_checked_against_the_vocabulary() -> None:
    """A sample the open-time sample missed still gives a DataError naming it, not an IndexError."""
    samples = [np.arange(10), np.array([1, 2, 300])]
    checked = training_data.VocabCheckedDataset(samples, 256, "training data x")
    assert checked[0].tolist() == list(range(10))
    with pytest.raises(DataError, match="training data x sample 1 holds token id 300, outside model.vocab_size 256"):
        checked[1]


# ---------------------------------------------------------------------------- item 3: tokenizer identity
def test_preprocess_writes_a_data_card_with_the_tokenizer_identity(toks: dict[str, Path], tmp_path: Path) -> None:
    """Fails on the old code: preprocess wrote no card, so nothing recorded which tokenizer made the data."""
    preprocess(PreprocessConfig([str(toks["text"])], str(toks["a"]), str(tmp_path / "d"), progress=False, docs_per_shard=150))
    for shard in ("d_00000", "d_00001"):
        card = read_data_card(tmp_path / shard)
        assert card["tokenizer"]["sha256"] == sha256_file(toks["a"])
        assert card["tokenizer"]["vocab_size"] == Tokenizer(toks["a"]).vocab_size == 300
    r = run_cli("data_prep.merge", "--input", str(tmp_path / "d_00000"), str(tmp_path / "d_00001"),
                "--output-prefix", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert read_data_card(tmp_path / "m")["tokenizer"] == read_data_card(tmp_path / "d_00000")["tokenizer"]


def test_training_start_checks_tokenizer_file_vocab_and_data_cards(toks: dict[str, Path], tmp_path: Path) -> None:
    """Fails on the old code: a missing data.tokenizer, a too small model.vocab_size and data from another
    tokenizer all passed the start of training."""
    preprocess(PreprocessConfig([str(toks["text"])], str(toks["a"]), str(tmp_path / "d"), progress=False))
    prefix = [str(tmp_path / "d")]
    cfg = tiny_cfg(tmp_path, train_path=prefix, tokenizer=str(tmp_path / "nope.model"))
    with pytest.raises(DataError, match=r"data.tokenizer \(from .*config.yaml\): tokenizer model .*nope.model not found"):
        training_data.check_data_tokenizer(cfg)
    cfg = tiny_cfg(tmp_path, train_path=prefix, tokenizer=str(toks["a"]))
    cfg.model.vocab_size = 200
    with pytest.raises(DataError, match=r"model.vocab_size \(from .*config.yaml\): 200 is smaller than .* \(300 tokens\)"):
        training_data.check_data_tokenizer(cfg)
    cfg = tiny_cfg(tmp_path, train_path=prefix)  # no data.tokenizer: the data card's vocabulary counts
    cfg.model.vocab_size = 200
    with pytest.raises(DataError, match=r"smaller than the vocabulary of the data .*d \(300 tokens\)"):
        training_data.check_data_tokenizer(cfg)
    cfg = tiny_cfg(tmp_path, train_path=prefix, tokenizer=str(toks["b"]))
    with pytest.raises(TokenizerMismatchError, match=r"the data .*d was made with .*tok_a.model .* but data.tokenizer"):
        training_data.check_data_tokenizer(cfg)
    record = training_data.check_data_tokenizer(tiny_cfg(tmp_path, train_path=prefix, tokenizer=str(toks["a"])))
    assert record == Tokenizer(toks["a"]).record


def test_eval_refuses_a_tokenizer_or_data_other_than_the_checkpoints(toks: dict[str, Path], tmp_path: Path) -> None:
    """Fails on the old code: evaluation never compared tokenizers, so it scored mismatched data."""
    a, b = Tokenizer(toks["a"]), Tokenizer(toks["b"])
    for name, tok in (("da", toks["a"]), ("db", toks["b"])):
        preprocess(PreprocessConfig([str(toks["text"])], str(tok), str(tmp_path / name), progress=False))
    check_eval_tokenizer(a.record, a, str(tmp_path / "da"), "ckpt")  # all agree
    with pytest.raises(TokenizerMismatchError, match=r"checkpoint ckpt was made with .*tok_a.model .* but the data .*db"):
        check_eval_tokenizer(a.record, a, str(tmp_path / "db"), "ckpt")
    with pytest.raises(TokenizerMismatchError, match="but the tokenizer in use is .*tok_b.model"):
        check_eval_tokenizer(a.record, b, str(toks["text"]), "ckpt")
    # a checkpoint without a record: the tokenizer in use is the reference for the data
    with pytest.raises(TokenizerMismatchError, match=r"the tokenizer in use was made with .*tok_a.model"):
        check_eval_tokenizer(None, a, str(tmp_path / "db"), "ckpt")
    with pytest.raises(DataError, match=r"document 0 of .* holds token id \d+, outside the model's vocabulary of 100"):
        load_eval_set(str(tmp_path / "da"), a, vocab_size=100)


def test_tokenizer_given_a_non_model_file_is_a_clear_error(toks: dict[str, Path], tmp_path: Path) -> None:
    """Fails on the old code: sentencepiece's 'could not parse ModelProto' named no file."""
    with pytest.raises(ValueError, match=r"model_path: .*a.txt is not a sentencepiece model"):
        Tokenizer(toks["text"])
    r = run_cli("data_prep.preprocess", "--input", str(toks["text"]), "--tokenizer", str(toks["text"]),
                "--output-prefix", str(tmp_path / "x"), "--no-progress")
    assert r.returncode == 2 and "a.txt is not a sentencepiece model" in r.stderr and "Traceback" not in r.stderr


def test_training_start_refuses_unreadable_and_lossy_tokenizers(toks: dict[str, Path], tmp_path: Path) -> None:
    """Issue 37: a malformed or EOD-less tokenizer.json was a traceback (exit 1) and a lossy one was
    accepted, its bits per byte then computed from the text it gives back."""
    from failure_helpers import foreign_tokenizer_file

    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    lossy = foreign_tokenizer_file(tmp_path / "unigram.json", "unigram", TEXT)
    cases = {bad: r"bad.json is not a tokenizers file \(",
             foreign_tokenizer_file(tmp_path / "wordpiece.json", "wordpiece", TEXT):
                 r"wordpiece.json names no end-of-document token",
             lossy: r"tokenizer .*unigram.json is lossy: decode\(encode\(text\)\) changes 'rown fox\\njumps  ' into "
                    r"'rown fox jumps  '; bits per byte and word counts would measure another text: use a lossless"}
    for path, message in cases.items():
        with pytest.raises(DataError, match=r"^data.tokenizer \(from .*config.yaml\): .*" + message):
            training_data.check_data_tokenizer(tiny_cfg(tmp_path, train_path=["unused"], tokenizer=str(path)))
    bpe = train_tokenizer(TokenizerTrainConfig(inputs=[str(toks["text"])], vocab_size=300, tokenizer_type="bpe",
                                               output_prefix=str(tmp_path / "bpe")))
    nofallback = train_tokenizer(TokenizerTrainConfig(inputs=[str(toks["text"])], vocab_size=300, byte_fallback=False,
                                                      output_prefix=str(tmp_path / "nofallback")))
    for lossless in (toks["a"], toks["b"], bpe):  # what data_prep writes passes the probe
        assert Tokenizer(lossless).lossless_problem() is None, lossless
    # without byte fallback, a character the corpus lacks (the capital T) decodes as <unk>
    assert "changes 'The quic' into ' ⁇ he qu'" in Tokenizer(nofallback).lossless_problem()


# ---------------------------------------------------------------------------- item 9: small ones
@pytest.mark.parametrize("vocab", ["0", "-5"])
def test_train_tokenizer_bad_vocab_size_is_a_clear_error(toks: dict[str, Path], tmp_path: Path, vocab: str) -> None:
    """Fails on the old code: the config was built outside the try, so a traceback came out."""
    r = run_cli("data_prep.train_tokenizer", "--input", str(toks["text"]), "--vocab-size", vocab,
                "--output-prefix", str(tmp_path / "t"))
    assert r.returncode == 2 and f"vocab_size: expected at least 8, got {vocab}" in r.stderr
    assert "Traceback" not in r.stderr


def test_malformed_and_binary_yaml_are_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Fails on the old code: yaml's ParserError and UnicodeDecodeError escaped as tracebacks."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  vocab_size: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: malformed YAML \(line 3, column 1\)"):
        load_config([bad])
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ConfigError, match=r"binary.yaml: not a YAML text file"):
        load_config([binary])
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"model:\x00\x01")
    from megaflex.training.train import main

    for path in (bad, nul):
        assert main(["--config", str(path)]) == 2
        assert f"config error: {path}: malformed YAML" in capsys.readouterr().err
    r = run_cli("megaflex.train", "--config", str(binary))
    assert r.returncode == 2 and f"config error: {binary}: not a YAML text file" in r.stderr and "Traceback" not in r.stderr


def test_truncated_sample_index_cache_is_rebuilt_with_a_warning(tmp_path: Path) -> None:
    """Fails on the old code: np.load raised 'mmap length is greater than file size'."""
    write_docs(tmp_path / "d", 60, vocab=250)
    cache = tmp_path / "cache"
    first = GPTDataset(str(tmp_path / "d"), "train", 8, 200, cache_dir=cache, split="1,0,0")
    expected = [first[i].tolist() for i in range(len(first))]
    sample_idx = first.cache_paths(cache)["sample_idx"]
    sample_idx.write_bytes(sample_idx.read_bytes()[:-40])
    with pytest.warns(UserWarning, match="unreadable or truncated; rebuilding them"):
        again = GPTDataset(str(tmp_path / "d"), "train", 8, 200, cache_dir=cache, split="1,0,0")
    assert again.built_indices and [again[i].tolist() for i in range(len(again))] == expected
    reloaded = GPTDataset(str(tmp_path / "d"), "train", 8, 200, cache_dir=cache, split="1,0,0")
    assert not reloaded.built_indices  # the rebuilt cache is complete


def test_training_caches_sample_indices_next_to_the_data_by_default(tmp_path: Path, monkeypatch) -> None:
    """Fails on the old code: data.cache_dir=None (documented 'next to the data') wrote no cache."""
    write_docs(tmp_path / "data" / "d", 60, vocab=250)
    cfg = tiny_cfg(tmp_path, train_path=[str(tmp_path / "data" / "d")], split="90,10,0")
    train, valid = training_data.build_datasets(cfg, train_samples=20, valid_samples=4)
    assert len(train) == 20 and valid is not None
    assert len(list((tmp_path / "data" / "index_cache").glob("*-gpt-train-description.json"))) == 1
    # a read-only data folder: the run directory takes the cache, with a warning
    monkeypatch.setattr(training_data, "_writable_dir", lambda path: False)
    with pytest.warns(UserWarning, match="is not writable; caching sample indices in .*run/index_cache"):
        assert training_data.index_cache_dir(cfg) == str(tmp_path / "run" / "index_cache")


def test_preprocess_and_train_tokenizer_refuse_to_overwrite(toks: dict[str, Path], tmp_path: Path) -> None:
    """Fails on the old code: both silently replaced existing outputs."""
    text = str(toks["text"])
    cfg = TokenizerTrainConfig(inputs=[text], vocab_size=300, output_prefix=str(toks["a"])[: -len(".model")])
    before = toks["a"].read_bytes()
    with pytest.raises(FileExistsError, match=r"tok_a.model, .*tok_a.card.json already exist; pass --overwrite"):
        train_tokenizer(cfg)
    assert toks["a"].read_bytes() == before
    r = run_cli("data_prep.train_tokenizer", "--input", text, "--vocab-size", "300", "--output-prefix",
                str(toks["a"])[: -len(".model")])
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr

    out = str(tmp_path / "d")
    preprocess(PreprocessConfig([text], str(toks["a"]), out, progress=False))
    with pytest.raises(FileExistsError, match=r"d.bin, .*d.idx, .*d.card.json already exist"):
        preprocess(PreprocessConfig([text], str(toks["b"]), out, progress=False))
    assert read_data_card(out)["tokenizer"]["sha256"] == sha256_file(toks["a"])  # untouched
    r = run_cli("data_prep.preprocess", "--input", text, "--tokenizer", str(toks["b"]), "--output-prefix", out,
                "--no-progress", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert read_data_card(out)["tokenizer"]["sha256"] == sha256_file(toks["b"])
    preprocess(PreprocessConfig([text], str(toks["a"]), str(tmp_path / "s"), docs_per_shard=150, progress=False))
    with pytest.raises(FileExistsError, match=r"s_00000.bin"):  # shards count as outputs too
        preprocess(PreprocessConfig([text], str(toks["a"]), str(tmp_path / "s"), docs_per_shard=100, progress=False))


@pytest.mark.parametrize("flag", ["--context", "--stride"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_eval_rejects_zero_context_and_stride(flag: str, value: str, capsys: pytest.CaptureFixture) -> None:
    """Fails on the old code: 0 was silently replaced by the default (``args.context or ...``)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--checkpoint", "c", "--data", "d", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected a positive integer, got {value}" in capsys.readouterr().err


def test_eval_has_the_encoding_errors_flag_its_message_suggests(tmp_path: Path) -> None:
    """Fails on the old code: the UTF-8 error said 'pass --encoding-errors replace', which megaflex-eval lacked."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xfe text\n")
    with pytest.raises(SourceError, match="at column 0; fix the file or pass --encoding-errors replace"):
        list(iter_documents(str(bad)))
    args = build_parser().parse_args(["--checkpoint", "c", "--data", str(bad), "--encoding-errors", "replace"])
    assert args.encoding_errors == "replace"

    class Chars:  # a stand-in tokenizer: one id per character
        eod_id = 0

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    docs = load_eval_set(str(bad), Chars(), encoding_errors="replace").docs
    assert "".join(map(chr, docs[0][1:].tolist())) == "ok\n\ufffd text\n"


@pytest.mark.parametrize("line,problem", [('{"text": ', "Expecting value"),
                                          ('{"text": "a\x01b"}', "Invalid control character")])
def test_invalid_json_message_says_at_once(tmp_path: Path, line: str, problem: str) -> None:
    """Fails on the old code: json's 'Invalid control character at' + our 'at column' read 'at at column'."""
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "a"}\n' + line + "\n")
    with pytest.raises(SourceError) as e:
        list(iter_documents(str(bad)))
    assert "b.jsonl:2: invalid JSON at column" in str(e.value) and str(e.value).endswith(problem)
    assert "at at" not in str(e.value)
