"""Data and tokenizer faults through real ``megaflex.train`` / ``megaflex-eval`` / ``megaflex-generate`` runs.

Two tokenizers of the same vocabulary size (BPE and unigram on the same WikiText text) and the same
text tokenized with each: the pair a user can mix up without any id ever leaving the vocabulary.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from data_prep.preprocess import PreprocessConfig, preprocess
from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer
from megaflex.data import Tokenizer
from megaflex.training.metrics import read_metrics
from data_files import shift_pointers
from training_harness import TINY, launch, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data_faults")
    text = root / "text.raw"
    raw = (shared_data / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")
    text.write_text(raw[: raw.index("\n", 80_000) + 1], encoding="utf-8")
    out = {"root": root, "text": text}
    for name, model_type in (("t1", "bpe"), ("t2", "unigram")):
        out[name] = train_tokenizer(TokenizerTrainConfig(inputs=[str(text)], vocab_size=512, model_type=model_type,
                                                         output_prefix=str(root / name), max_sentences=3000))
        out[f"d{name[1]}"] = root / f"data_{name}"
        preprocess(PreprocessConfig([str(text)], str(out[name]), str(out[f"d{name[1]}"]), doc_mode="line",
                                    progress=False))
    config = copy.deepcopy(TINY)
    config["model"].update(vocab_size=512)
    config["data"] = {"source": "indexed", "seq_len": 64, "split": "90,10,0"}
    config["train"].update(train_iters=2, global_batch_size=4)
    config["schedule"].update(warmup_iters=0)
    config["checkpoint"] = {"save_interval": 0}
    out["config"] = write_config(root / "config.yaml", config)
    return out


def train(setup: dict[str, Path], run: str, *overrides: str, tokenizer: str = "t1", data: str = "d1"):
    return launch(setup["config"], [f"logging.run_dir={setup['root'] / run}", f"data.train_path=[{setup[data]}]",
                                    f"data.tokenizer={setup[tokenizer]}", *overrides])


@pytest.fixture(scope="module")
def good_run(setup: dict[str, Path]) -> Path:
    result = train(setup, "good", "parallel.zero_stage=0", "train.precision=fp32")
    assert result.returncodes == [0], result.output
    return setup["root"] / "good"


def test_training_on_shifted_pointers_fails_at_start_naming_the_file(setup: dict[str, Path]) -> None:
    """Fails on the old code: it trained to the end (rc 0) on misaligned token ids."""
    corrupt = setup["root"] / "corrupt"
    corrupt.mkdir()
    for ext in ("bin", "idx", "card.json"):
        if Path(f"{setup['d1']}.{ext}").is_file():
            shutil.copy(f"{setup['d1']}.{ext}", corrupt / f"d.{ext}")
    shift_pointers(corrupt / "d", -2, slice(1, None))
    result = train(setup, "corrupt_run", f"data.train_path=[{corrupt / 'd'}]")
    assert result.returncodes == [2], result.output
    assert f"data error: {corrupt / 'd.idx'}: " in result.output and "pointers disagree" in result.output
    assert "step 1/" not in result.output


def test_vocab_and_tokenizer_faults_fail_at_start(setup: dict[str, Path]) -> None:
    """Fails on the old code: vocab 256 < 512 ended in 'IndexError: index out of range in self' mid-step,
    a missing data.tokenizer trained with rc 0."""
    result = train(setup, "small_vocab", "model.vocab_size=256")
    assert result.returncodes == [2], result.output
    assert "data error: model.vocab_size (from command line): 256 is smaller than the vocabulary" in result.output
    assert "IndexError" not in result.output and "step 1/" not in result.output
    missing = setup["root"] / "missing.model"
    result = train(setup, "missing_tok", f"data.tokenizer={missing}")
    assert result.returncodes == [2], result.output
    assert f"data error: data.tokenizer (from command line): tokenizer model {missing} not found" in result.output


def test_zero0_fp32_logs_the_gradient_norm_that_zero1_logs(setup: dict[str, Path], good_run: Path) -> None:
    """Fails on the old code: grad_norm was null in metrics.jsonl for ZeRO-0 fp32."""
    zero0 = read_metrics(good_run / "metrics.jsonl")
    result = train(setup, "zero1", "parallel.zero_stage=1", "train.precision=fp32")
    assert result.returncodes == [0], result.output
    zero1 = read_metrics(setup["root"] / "zero1" / "metrics.jsonl")
    tp2 = launch(setup["config"], [f"logging.run_dir={setup['root'] / 'zero0tp2'}", f"data.train_path=[{setup['d1']}]",
                                   f"data.tokenizer={setup['t1']}", "parallel.zero_stage=0", "train.precision=fp32",
                                   "parallel.tensor_parallel_size=2"], world_size=2)
    assert tp2.returncodes == [0, 0], tp2.output
    zero0_tp2 = read_metrics(setup["root"] / "zero0tp2" / "metrics.jsonl")
    assert zero0[1]["grad_norm"] is not None and zero0[1]["grad_norm"] > 0
    # same seed, data and weights at step 1: the unclipped norm every layout sees must agree
    # (TP 2: sharded parameters counted on both ranks, replicated ones once)
    assert zero0[1]["grad_norm"] == pytest.approx(zero1[1]["grad_norm"], rel=1e-4)
    assert zero0_tp2[1]["grad_norm"] == pytest.approx(zero1[1]["grad_norm"], rel=1e-4)


def test_checkpoint_records_the_tokenizer_and_resume_refuses_another(setup: dict[str, Path], good_run: Path) -> None:
    """Fails on the old code: no record in megaflex.json, and resuming with the other tokenizer's data ran."""
    meta = json.loads(next((good_run / "checkpoints").glob("step_*/megaflex.json")).read_text())
    assert meta["tokenizer"] == Tokenizer(setup["t1"]).record
    result = train(setup, "resume_t2", f"checkpoint.dir={good_run / 'checkpoints'}", "train.train_iters=4",
                   tokenizer="t2", data="d2")
    assert result.returncodes == [2], result.output
    assert "data error: tokenizer mismatch: checkpoint" in result.output and "t2.model" in result.output


def test_eval_and_generate_refuse_another_tokenizer(setup: dict[str, Path], good_run: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """Fails on the old code: eval on data_t2 returned a plausible perplexity with rc 0."""
    from megaflex.eval.generate import main as generate
    from megaflex.eval.perplexity import main as evaluate

    common = ["--checkpoint", str(good_run), "--mode", "windows", "--context", "64", "--max-tokens", "2000"]
    assert evaluate(common + ["--data", str(setup["d1"])]) == 0
    assert "ppl" in capsys.readouterr().out
    assert evaluate(common + ["--data", str(setup["d2"])]) == 2
    err = capsys.readouterr().err
    assert "megaflex-eval: error: tokenizer mismatch" in err and str(setup["d2"]) in err
    assert evaluate(common + ["--data", str(setup["text"]), "--tokenizer", str(setup["t2"])]) == 2
    assert "but the tokenizer in use is " + str(setup["t2"]) in capsys.readouterr().err
    prompt = ["--checkpoint", str(good_run), "--prompt", " = Valkyria", "--max-new-tokens", "3", "--temperature", "0"]
    assert generate(prompt + ["--tokenizer", str(setup["t2"])]) == 2
    assert "megaflex-generate: error: tokenizer mismatch" in capsys.readouterr().err
    assert generate(prompt) == 0
    assert capsys.readouterr().out.startswith(" = Valkyria")
