"""A Hugging Face ``tokenizers`` file (byte-level BPE trained here on real WikiText) through the
whole tool chain: train_tokenizer --type bpe, preprocess, a tiny training run, evaluation,
export to HF (the exported tokenizer gives the same ids) and back, and card mismatch refusals."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distributed import run_distributed
from megaflex.data.card import TokenizerMismatchError, data_tokenizer
from megaflex.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from training_harness import tiny_eval_train_args, train_rank
from training_harness import tokenized_wikitext

REPO = Path(__file__).resolve().parents[2]


def _train_bpe(data: Path, prefix: str, vocab: int) -> Path:
    subprocess.run([sys.executable, "-m", "data_prep.train_tokenizer", "--type", "bpe", "--input", str(data / "train.raw"),
                    "--vocab-size", str(vocab), "--output-prefix", str(data / prefix)], check=True, cwd=REPO,
                   capture_output=True)
    return data / f"{prefix}.json"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict[str, Path]:
    """A BPE tokenizer, WikiText data preprocessed with it, and a 2-step training run over it."""
    root = tmp_path_factory.mktemp("bpe")
    data = tokenized_wikitext(root / "data", shared_data, train_chars=150_000, tokenizer_type="bpe")
    tok = data / "tok.json"
    run = root / "run"
    args = [a if not a.startswith("data.tokenizer=") else f"data.tokenizer={tok}" for a in tiny_eval_train_args(data, run, 0, 1)]
    assert run_distributed(train_rank, 1, args=(args,), init_process_group=False) == [0]
    return {"root": root, "data": data, "tok": tok, "run": run}


def test_bpe_tokenizer_is_lossless_with_card_and_byte_counts(bpe_run: dict[str, Path], shared_data: Path) -> None:
    tok = Tokenizer(bpe_run["tok"])
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 512
    assert tok.card is not None and tok.card.library == "tokenizers" and tok.eod_id == tok.card.eos_id
    assert tok.id_to_piece(tok.eod_id) == "<|endoftext|>" and tok.unk_id == -1
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:20_000] + " naïve 😀\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.num_bytes(ids) == len(text.encode("utf-8"))
    assert tok.decode([tok.eod_id] + ids[:5]) == tok.decode(ids[:5])  # control tokens decode to nothing
    assert tok.encode_batch([text[:300], text[300:600]]) == [tok.encode(text[:300]), tok.encode(text[300:600])]
    assert pickle.loads(pickle.dumps(tok)).encode(text[:500]) == tok.encode(text[:500])
    assert tok.record["sha256"] == data_tokenizer(bpe_run["data"] / "train")["sha256"]  # the data card


def test_bpe_training_is_deterministic(bpe_run: dict[str, Path]) -> None:
    again = _train_bpe(bpe_run["data"], "tok_again", 512)
    assert again.read_bytes() == bpe_run["tok"].read_bytes()


def test_preprocessed_tokens_are_the_tokenizer_ids(bpe_run: dict[str, Path]) -> None:
    from megaflex.data.indexed import IndexedDataset

    tok = Tokenizer(bpe_run["tok"])
    ds = IndexedDataset(bpe_run["data"] / "train")
    first = np.asarray(ds.get(0))
    assert first[-1] == tok.eod_id and tok.decode(first[:-1]).strip()
    assert tok.encode(tok.decode(first[:-1])) == first[:-1].tolist()


def test_training_records_the_bpe_and_evaluation_refuses_another(bpe_run: dict[str, Path], tmp_path: Path) -> None:
    from megaflex.eval.loading import load_for_eval
    from megaflex.eval.perplexity import run_cli

    loaded = load_for_eval(bpe_run["run"])
    assert isinstance(loaded.tokenizer, HFTokenizer) and loaded.meta.tokenizer["sha256"] == loaded.tokenizer.record["sha256"]
    result = run_cli(["--checkpoint", str(bpe_run["run"]), "--data", str(bpe_run["data"] / "train.raw"),
                      "--max-tokens", "300", "--context", "64", "--device", "cpu"])
    assert result["tokens"] > 0 and np.isfinite(result["ppl"]) and result["bits_per_byte"] > 0
    other = _train_bpe(bpe_run["data"], "other", 400)
    with pytest.raises(TokenizerMismatchError, match="tokenizer mismatch"):
        run_cli(["--checkpoint", str(bpe_run["run"]), "--tokenizer", str(other), "--data", str(bpe_run["data"] / "train.raw"),
                 "--max-tokens", "300", "--context", "64", "--device", "cpu"])
    with pytest.raises(TokenizerMismatchError, match="tokenizer mismatch"):  # data made with the BPE, scored with another
        run_cli(["--checkpoint", str(bpe_run["run"]), "--tokenizer", str(other), "--data", str(bpe_run["data"] / "test"),
                 "--device", "cpu"])


def test_generate_cli_streams_the_bpe_text(bpe_run: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    import torch

    from megaflex.eval.generate import SamplingConfig, generate
    from megaflex.eval.generate import main as generate_main
    from megaflex.eval.loading import load_for_eval

    prompt = "The history of the"
    assert generate_main(["--checkpoint", str(bpe_run["run"]), "--prompt", prompt, "--max-new-tokens", "12",
                          "--temperature", "0"]) == 0
    loaded = load_for_eval(bpe_run["run"])
    ids = torch.tensor([loaded.tokenizer.encode(prompt)])
    expected = loaded.tokenizer.decode(ids[0].tolist() + generate(loaded.model, ids, 12, SamplingConfig(temperature=0))[0].tolist())
    assert capsys.readouterr().out == expected + "\n"


def test_training_refuses_data_of_another_tokenizer(bpe_run: dict[str, Path], tmp_path: Path) -> None:
    from megaflex.training.config import load_config
    from megaflex.training.data import check_data_tokenizer

    other = _train_bpe(bpe_run["data"], "other2", 400)
    args = [a if not a.startswith("data.tokenizer=") else f"data.tokenizer={other}"
            for a in tiny_eval_train_args(bpe_run["data"], tmp_path / "run", 0, 1)]
    cfg = load_config([args[1]], args[2:])
    with pytest.raises(TokenizerMismatchError, match="tokenizer mismatch"):
        check_data_tokenizer(cfg)


def test_export_keeps_the_bpe_ids_and_identity(bpe_run: dict[str, Path], shared_data: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from megaflex.hf.export import export_checkpoint, import_hf
    from megaflex.eval.loading import load_for_eval

    hf = export_checkpoint(bpe_run["run"], tmp_path / "hf")
    assert (hf / "megaflex_tokenizer.json").read_bytes() == bpe_run["tok"].read_bytes()
    hf_tok = AutoTokenizer.from_pretrained(hf)
    tok = Tokenizer(bpe_run["tok"])
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:5_000]
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text) and hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == tok.eod_id == hf_tok.bos_token_id and hf_tok.pad_token_id == tok.pad_id
    back = import_hf(hf, tmp_path / "back")
    restored = load_for_eval(back)
    assert isinstance(restored.tokenizer, HFTokenizer) and restored.tokenizer.record["sha256"] == tok.record["sha256"]


def test_sentencepiece_still_dispatches(tmp_path: Path, bpe_run: dict[str, Path]) -> None:
    subprocess.run([sys.executable, "-m", "data_prep.train_tokenizer", "--input", str(bpe_run["data"] / "train.raw"),
                    "--vocab-size", "512", "--output-prefix", str(tmp_path / "sp")], check=True, cwd=REPO, capture_output=True)
    sp = Tokenizer(tmp_path / "sp.model")
    assert isinstance(sp, SentencePieceTokenizer) and sp.card is not None and sp.card.library == "sentencepiece"
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="bad.json is not a tokenizers file"):
        Tokenizer(bad)


def test_tokenizer_json_without_card_finds_its_eod(bpe_run: dict[str, Path], tmp_path: Path) -> None:
    """Any tokenizer.json (no megaflex card): EOD is its <|endoftext|>-style special token."""
    bare = tmp_path / "tokenizer.json"
    bare.write_bytes(bpe_run["tok"].read_bytes())
    tok, carded = Tokenizer(bare), Tokenizer(bpe_run["tok"])
    assert tok.card is None and (tok.eod_id, tok.pad_id, tok.bos_id) == (carded.eod_id, carded.pad_id, carded.bos_id)
    assert tok.record["sha256"] == carded.record["sha256"]  # the same file is the same tokenizer
    config = json.loads(bare.read_text())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != "<|endoftext|>"]
    bare.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names no end-of-document token"):
        Tokenizer(bare)
