"""Settings that would have no effect: a warning line each (or a refusal where the run would be
wrong), checked on their own and printed by a real run (tiny model, CPU)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megaflex.data.card import write_data_card
from megaflex.data.indexed import DataError
from megaflex.training.config import ConfigError, config_warnings, load_config
from megaflex.training.data import check_document_boundaries
from training_harness import TINY, launch, write_config, write_pattern_data

SHORT = copy.deepcopy(TINY)
SHORT["train"].update(train_iters=2, eval_iters=1)
SHORT["schedule"].update(warmup_iters=0)
SHORT["checkpoint"].update(save_interval=0)
SHORT["logging"].update(kernel_stats_interval=0)

CARD_TOKENIZER = {"sha256": "x", "vocab_size": 200, "path": "tok.model"}  # a tokenizer smaller than model.vocab_size 256


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    return write_config(tmp_path / "c.yaml", SHORT)


def test_settings_without_effect_are_warned(cfg_file: Path) -> None:
    warnings = config_warnings(load_config([str(cfg_file)], ["data.eod_token_id=3", "model.window_mixing=gated"]))
    assert warnings == [
        "WARNING: data.eod_token_id (from command line) has no effect: it acts only with "
        "data.document_boundaries=reset, got 'none'",
        "WARNING: model.window_mixing=gated (from command line) has no effect: it acts only with a window, "
        "model.softmax_window > 0, got 0",
    ]
    # where they act, or left at their defaults: nothing to say
    assert config_warnings(load_config([str(cfg_file)], [])) == []
    assert config_warnings(load_config([str(cfg_file)], [
        "data.eod_token_id=3", "data.document_boundaries=reset", "model.window_mixing=gated", "model.softmax_window=4",
    ])) == []


def test_a_chunked_loss_under_pipeline_parallelism_is_warned(cfg_file: Path) -> None:
    pipelined = ["parallel.pipeline_parallel_size=2", "parallel.zero_stage=1"]
    assert config_warnings(load_config([str(cfg_file)], [*pipelined, "train.loss_chunk_tokens=256"])) == [
        "WARNING: train.loss_chunk_tokens=256 (from command line) has no effect under pipeline parallelism: the "
        "last stage computes the whole logits",
    ]
    assert config_warnings(load_config([str(cfg_file)], pipelined)) == []  # the default: nothing asked for
    assert config_warnings(load_config([str(cfg_file)], ["train.loss_chunk_tokens=256"])) == []


@pytest.mark.parametrize("eod", [256, -1])
def test_eod_token_id_outside_the_model_vocabulary_is_a_config_error(cfg_file: Path, eod: int) -> None:
    with pytest.raises(ConfigError, match=rf"^data.eod_token_id \(from command line\): expected an id in "
                                          rf"\[0, model.vocab_size=256\), got {eod};"):
        load_config([str(cfg_file)], [f"data.eod_token_id={eod}", "data.document_boundaries=reset"])


def _reset_config(cfg_file: Path, prefix: Path, *overrides: str):
    return load_config([str(cfg_file)], ["data.source=indexed", f"data.train_path=[{prefix}]",
                                         "data.document_boundaries=reset", *overrides])


def test_document_boundaries_are_checked_against_the_data_cards(cfg_file: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "docs"
    write_data_card(prefix, CARD_TOKENIZER, append_eod=True, eod_id=2)
    assert check_document_boundaries(_reset_config(cfg_file, prefix, "data.eod_token_id=2")) == []
    # inside model.vocab_size but outside the data's tokenizer: no token has it, no reset would happen
    with pytest.raises(DataError, match=rf"^data.eod_token_id \(from command line\): 230 is outside the vocabulary "
                                        rf"of the data {prefix} \(200 tokens, its data card\).* its EOD id is 2"):
        check_document_boundaries(_reset_config(cfg_file, prefix, "data.eod_token_id=230"))
    assert check_document_boundaries(_reset_config(cfg_file, prefix, "data.eod_token_id=5")) == [
        f"WARNING: data.eod_token_id=5 (from command line) is not the EOD id 2 that ends each document of the data "
        f"{prefix} (data card): resets cut after token 5, not at the documents' ends"]
    write_data_card(prefix, CARD_TOKENIZER, append_eod=False, eod_id=2)  # tokenized with --no-append-eod
    warnings = check_document_boundaries(_reset_config(cfg_file, prefix, "data.eod_token_id=2"))
    assert warnings == [f"WARNING: data.document_boundaries=reset: the data {prefix} was tokenized without an EOD "
                        "after each document (data card: append_eod false), so its samples have no boundary to reset "
                        "at; re-tokenize it without --no-append-eod, or set data.document_boundaries=none"]
    # without document resets the cards are not consulted
    assert check_document_boundaries(_reset_config(cfg_file, prefix, "data.document_boundaries=none")) == []


@pytest.mark.slow
@pytest.mark.usefixtures("forked_python")
def test_a_run_prints_each_warning_once(cfg_file: Path, tmp_path: Path) -> None:
    """Fresh run: window_mixing without a window, resets on data without EODs. Its resume: the
    EOD id without resets, and a profile window that lies before the resumed step."""
    data = write_pattern_data(tmp_path)
    prefix = data[1].split("=[", 1)[1].rstrip("]")
    write_data_card(prefix, {**CARD_TOKENIZER, "vocab_size": 256}, append_eod=False, eod_id=0)
    run = [f"logging.run_dir={tmp_path / 'run'}", *data]
    first = launch(cfg_file, [*run, "model.window_mixing=gated", "data.document_boundaries=reset",
                              "data.eod_token_id=0"])
    assert first.returncodes == [0], first.output
    out = first.outputs[0]
    assert out.count("WARNING: model.window_mixing=gated (from command line) has no effect") == 1
    assert out.count("WARNING: data.document_boundaries=reset: the data") == 1 and "append_eod false" in out
    # issue 45: a quiet first screen, one line of parameter-group counts and no DeepSpeed warning about it
    assert out.count("optimizer: 4 parameter groups: ") == 1 and "attn_norm.weight" not in out
    assert "untested optimizer" not in out
    second = launch(cfg_file, [*run, "model.window_mixing=gated", "data.eod_token_id=0", "train.train_iters=3",
                               "logging.profile.start=2", "logging.profile.steps=2"])
    assert second.returncodes == [0], second.output
    out = second.outputs[0]
    assert "resumed from" in out and out.count("WARNING: data.eod_token_id (from command line) has no effect") == 1
    assert out.count("WARNING: logging.profile: steps 2-3 are not profiled, this run resumed at step 2; "
                     "set logging.profile.start above 2 to profile") == 1
    assert not (tmp_path / "run" / "profile").exists()
