"""The failure-modes tables of docs/training.md, row by row.

Every row has an entry in ``CASES`` (and every entry a row): either a case run here, which must
exit with the status the row documents ("exit N" in the row, else the table's "exits with status
N"; 0 when it documents none) and print exactly one ``error:`` line and no traceback when it
fails, or the test elsewhere that covers the row (launcher, signal and disk-full faults need
multi-process set-ups of their own). Commands whose errors come before any process group run
in-process; trainer faults run as one tiny ``megaflex.train`` process each (marked slow).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from failure_helpers import foreign_tokenizer_file, one_error_line
from training_harness import PYTHON, REPO, TINY, base_env, deepspeed_launcher, write_config

DOC = REPO / "docs" / "training.md"
TEXT = "".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog number {i * 13 % 101}\n" for i in range(400))


# ------------------------------------------------------------------------------- the docs tables
@dataclass
class Row:
    table: str
    fault: str
    happens: str
    status: int  # documented exit status (0 when none is documented)


def documented_rows() -> list[Row]:
    section = DOC.read_text().split("\n## Failure modes\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for part in section.split("\n### ")[1:]:
        title, _, body = part.partition("\n")
        preamble = body.split("\n|", 1)[0]
        default = re.search(r"exits with status (\d+)", preamble)
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("| ") or len(cells) != 3 or cells[0] == "fault" or set(cells[0]) <= set("-"):
                continue
            status = re.search(r"\bexits? (\d+)", cells[1])
            code = int(status.group(1)) if status else int(default.group(1)) if default else 0
            rows.append(Row(title.strip(), cells[0], cells[1], code))
    return rows


ROWS = {row.fault: row for row in documented_rows()}


# ------------------------------------------------------------------------------- running commands
@dataclass
class Outcome:
    prog: str
    returncode: int
    stderr: str


def in_process(prog: str, main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    capsys.readouterr()
    rc = main(argv)
    return Outcome(prog, rc, capsys.readouterr().err)


def subprocess_run(prog: str, cmd: list[str], env: dict[str, str] | None = None) -> Outcome:
    env = env or base_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return Outcome(prog, done.returncode, done.stderr + done.stdout)


def train(cfg: Path, *overrides: str) -> Outcome:
    return subprocess_run("megaflex-train", [PYTHON, "-m", "megaflex.train", "--config", str(cfg), *overrides])


def train_in_process(argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    from megaflex.training.train import main

    return in_process("megaflex-train", main, argv, capsys)


def export(argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    from megaflex.hf.export import main

    return in_process("megaflex-export", main, argv, capsys)


def generate(argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    from megaflex.eval.generate import main

    return in_process("megaflex-generate", main, argv, capsys)


def evaluate(argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    from megaflex.eval.perplexity import main

    return in_process("megaflex-eval", main, argv, capsys)


# ------------------------------------------------------------------------------- shared set-up
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 300-piece tokenizer, a 2-step ZeRO 1 run with it (model vocabulary 512: padded beyond the
    tokenizer's), its HF export, and a small indexed dataset."""
    from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer
    from megaflex.hf.export import export_checkpoint
    from data_files import write_docs

    root = tmp_path_factory.mktemp("failure_modes")
    (root / "text.txt").write_text(TEXT)
    tok = train_tokenizer(TokenizerTrainConfig(inputs=[str(root / "text.txt")], vocab_size=300,
                                               output_prefix=str(root / "tok")))
    config = copy.deepcopy(TINY)
    config["model"]["vocab_size"] = 512
    config["data"]["tokenizer"] = str(tok)
    config["train"].update(train_iters=2)
    config["schedule"].update(warmup_iters=0)
    config["checkpoint"].update(save_interval=0)
    config["logging"].update(kernel_stats_interval=0, run_dir=str(root / "run"))
    cfg = write_config(root / "config.yaml", config)
    result = train(cfg, "parallel.zero_stage=1")
    assert result.returncode == 0, result.stderr[-3000:]
    export_checkpoint(root / "run", root / "hf")
    write_docs(root / "docs", 20, 200)
    return {"root": root, "config": cfg, "tok": Path(tok), "run": root / "run", "ckpt": root / "run" / "checkpoints",
            "tag": root / "run" / "checkpoints" / "step_00000002", "hf": root / "hf", "docs": root / "docs"}


def _copy_run(world: dict[str, Path], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    return run


def _indexed_config(world: dict[str, Path], tmp_path: Path, **data: object) -> Path:
    config = yaml.safe_load(world["config"].read_text())
    config["data"] = {"source": "indexed", "seq_len": 64, "train_path": [str(world["docs"])], **data}
    config["model"]["vocab_size"] = 512
    config["logging"]["run_dir"] = str(tmp_path / "run")
    return write_config(tmp_path / "indexed.yaml", config)


# ------------------------------------------------------------------------------- the cases
# Each case: (world, tmp_path, capsys) -> Outcome; `expect` is a substring of its error line (or,
# for a case that succeeds, of its output).
@dataclass
class Case:
    run: Callable[[dict[str, Path], Path, pytest.CaptureFixture], Outcome] | None = None
    expect: str = ""
    covered_by: str = ""  # "tests/file.py::test_name" when another test runs this row
    slow: bool = False


def _yaml_alias(world, tmp_path, capsys):
    loop = tmp_path / "loop.yaml"
    loop.write_text("train: &t\n  lr: 0.1\n  again: *t\n")
    return train_in_process(["--config", str(world["config"]), str(loop)], capsys)


def _malformed_yaml(world, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    return train_in_process(["--config", str(bad)], capsys)


def _blend_zero(world, tmp_path, capsys):
    return train_in_process(["--config", str(world["config"]), "data.source=indexed", "data.train_path=[a,b]",
                             "data.train_weights=[0,0]"], capsys)


def _stale_card(world, tmp_path, capsys):
    from data_prep.inspect import main as inspect_main
    from data_files import write_docs

    from megaflex.data.card import write_data_card

    write_docs(tmp_path / "a", 20, 200, seed=1)
    write_data_card(tmp_path / "a", {"sha256": "x", "vocab_size": 300, "path": "tok"}, documents=20)
    write_docs(tmp_path / "a", 25, 200, seed=2)  # re-made without its card
    assert inspect_main([str(tmp_path / "a"), "--verify"]) == 1
    assert "a data card from another preprocessing run" in capsys.readouterr().err
    config = _indexed_config(world, tmp_path, train_path=[str(tmp_path / "a")], tokenizer=None)
    return train(config)


def _symlink_loop(world, tmp_path, capsys):
    for ext in ("bin", "idx"):
        os.symlink(f"b.{ext}", tmp_path / f"a.{ext}")
        os.symlink(f"a.{ext}", tmp_path / f"b.{ext}")
    from megaflex.data import IndexedDataset, IndexedDatasetError

    (tmp_path / "dir.idx").mkdir()
    with pytest.raises(IndexedDatasetError, match="dir.idx: is a directory, not a file"):
        IndexedDataset(tmp_path / "dir")
    return train(_indexed_config(world, tmp_path, train_path=[str(tmp_path / "a")], tokenizer=None))


def _resume_other_stage(world, tmp_path, capsys):
    run = _copy_run(world, tmp_path)
    return train(world["config"], f"logging.run_dir={run}", "parallel.zero_stage=3", "train.train_iters=3")


def _resume_weights_only(world, tmp_path, capsys):
    assert export(["--from-hf", str(world["hf"]), "--megaflex-out", str(tmp_path / "imported")], capsys).returncode == 0
    return train(world["config"], f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'imported'}",
                 "parallel.zero_stage=0", "train.train_iters=3")


# --- issue 37 (third probe): resume field checks, silent settings, signals
def _resume_other_position(world, tmp_path, capsys):
    return train(world["config"], f"logging.run_dir={_copy_run(world, tmp_path)}", "model.position=none",
                 "train.train_iters=3")


def _resume_without_normalization(world, tmp_path, capsys):
    """A checkpoint of an rms run as versions before model.normalization wrote it, resumed under the new default."""
    run = tmp_path / "run"
    assert train(world["config"], f"logging.run_dir={run}", "model.normalization=rms").returncode == 0
    meta = run / "checkpoints" / "step_00000002" / "megaflex.json"
    data = json.loads(meta.read_text())
    del data["config"]["model"]["normalization"]
    meta.write_text(json.dumps(data))
    return train(world["config"], f"logging.run_dir={run}", "train.train_iters=3")


def _undecodable_latest(world, tmp_path, capsys):
    run = _copy_run(world, tmp_path)
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    return generate(["--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "3"], capsys)


def _padded_vocab_generation(world, tmp_path, capsys):
    return generate(["--checkpoint", str(world["run"]), "--prompt", "the quick brown", "--max-new-tokens", "200",
                     "--temperature", "3.0", "--seed", "1"], capsys)


def _truncated_meta(world, tmp_path, capsys):
    run = _copy_run(world, tmp_path)
    meta = run / "checkpoints" / "step_00000002" / "megaflex.json"
    meta.write_bytes(meta.read_bytes()[:100])
    return generate(["--checkpoint", str(meta.parent), "--prompt", "the quick"], capsys)


def _missing_shard(world, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(world["hf"], hf)
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return export(["--from-hf", str(hf), "--megaflex-out", str(tmp_path / "out")], capsys)


def _non_empty_out(world, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("mine")
    return export(["--checkpoint", str(world["run"]), "--hf-out", str(tmp_path / "mine")], capsys)


def _unwritable_checkpoint_dir(world, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    return train(world["config"], f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'a_file' / 'ck'}")


def _damaged_shard(world, tmp_path, capsys):
    run = _copy_run(world, tmp_path)
    shard = next((run / "checkpoints" / "step_00000002").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return generate(["--checkpoint", str(shard.parent), "--prompt", "the quick"], capsys)


def _deepspeed_dash_m(world, tmp_path, capsys):
    env = base_env()
    env["LOCAL_SIZE"] = "1"
    env["PATH"] = str(Path(PYTHON).parent) + os.pathsep + env["PATH"]
    return subprocess_run("deepspeed", [deepspeed_launcher(), "--num_gpus", "1", "-m", "megaflex.train", "--config",
                                        str(world["config"])], env)


# --- issue 37 (a third probe's bad inputs)
def _not_a_tokenizer(world, tmp_path, capsys):
    from megaflex.data.tokenizer import Tokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    wordpiece = foreign_tokenizer_file(tmp_path / "wordpiece.json", "wordpiece", TEXT)
    with pytest.raises(ValueError, match="names no end-of-document token"):
        Tokenizer(wordpiece)
    outcome = train(world["config"], f"logging.run_dir={tmp_path / 'run'}", f"data.tokenizer={wordpiece}")
    assert outcome.returncode == 2 and "wordpiece.json names no end-of-document token" in \
        one_error_line(outcome.stderr, "megaflex-train")
    return train(world["config"], f"logging.run_dir={tmp_path / 'run'}", f"data.tokenizer={bad}")


def _lossy_tokenizer(world, tmp_path, capsys):
    from megaflex.data.tokenizer import Tokenizer

    lossy = foreign_tokenizer_file(tmp_path / "unigram.json", "unigram", TEXT)
    assert Tokenizer(lossy).lossless_problem() == "decode(encode(text)) changes 'rown fox\\njumps  ' into 'rown fox jumps  '"
    assert Tokenizer(world["tok"]).lossless_problem() is None  # data_prep's sentencepiece model
    evaluated = evaluate(["--checkpoint", str(world["run"]), "--data", str(world["root"] / "text.txt"),
                          "--tokenizer", str(lossy)], capsys)
    assert evaluated.returncode == 2 and "--tokenizer: tokenizer " in one_error_line(evaluated.stderr, "megaflex-eval")
    assert "unigram.json is lossy" in evaluated.stderr
    return train(world["config"], f"logging.run_dir={tmp_path / 'run'}", f"data.tokenizer={lossy}")


def _jsonl_without_text(world, tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": line}) + "\n" for line in TEXT.splitlines()[:20]))
    ok = evaluate(["--checkpoint", str(world["run"]), "--data", str(data), "--json-key", "body"], capsys)
    assert ok.returncode == 0, ok.stderr  # the flag the message names exists
    return evaluate(["--checkpoint", str(world["run"]), "--data", str(data)], capsys)


def _triton_on_cpu(world, tmp_path, capsys):
    env = base_env()
    env.pop("TRITON_INTERPRET", None)
    return subprocess_run("megaflex-train", [PYTHON, "-m", "megaflex.train", "--config", str(world["config"]),
                                             f"logging.run_dir={tmp_path / 'run'}", "model.attention_backend=triton"], env)


def _bidirectional_checkpoint(world, tmp_path, capsys):
    """A checkpoint trained with model.causal=false (before megaflex-train refused it)."""
    run = _copy_run(world, tmp_path)
    meta = run / "checkpoints" / "step_00000002" / "megaflex.json"
    data = json.loads(meta.read_text())
    data["config"]["model"]["causal"] = False
    meta.write_text(json.dumps(data))
    generated = generate(["--checkpoint", str(run), "--prompt", "the quick"], capsys)
    assert generated.returncode == 2 and "model.causal: false), which sees every token it is asked to predict: " \
        "generation needs a causal language model" in one_error_line(generated.stderr, "megaflex-generate")
    return evaluate(["--checkpoint", str(run), "--data", str(world["root"] / "text.txt")], capsys)


def _unwritable_run_dir(world, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")  # a path under a regular file: refused for root too, unlike chmod
    outcome = train(world["config"], f"logging.run_dir={tmp_path / 'a_file' / 'run'}")
    assert (tmp_path / "a_file").read_text() == "x"
    return outcome


CASES: dict[str, Case] = {
    # --- Launch and checkpoint faults
    "`-m megaflex.train` given to deepspeed": Case(_deepspeed_dash_m, "unrecognized arguments: -m", slow=True),
    "checkpoint dir not writable (or not a directory)": Case(
        _unwritable_checkpoint_dir, "is not writable: Not a directory", slow=True),
    "little free space in the checkpoint dir": Case(
        covered_by="tests/checkpoint/test_checkpoint_layout.py::test_unwritable_checkpoint_dir_is_refused_and_low_space_warned"),
    "disk full during a save": Case(
        covered_by="tests/training/test_training_faults.py::test_disk_full_during_save_keeps_the_previous_checkpoint"),
    "truncated/damaged shard, RNG file or `megaflex.json`": Case(_damaged_shard, "bytes, expected"),
    "kill -9 / power loss during a save": Case(
        covered_by="tests/training/test_training_resume.py::test_kill_during_save_keeps_previous_checkpoint"),
    "SIGTERM/SIGINT/SIGUSR1 to `launch/train.sh`": Case(
        covered_by="tests/training/test_training_faults.py::test_sigterm_reaches_the_ranks_which_save_and_exit"),
    "SIGTERM to the `deepspeed` runner itself (or `timeout deepspeed ...`)": Case(
        covered_by="tests/training/test_training_faults.py::test_sigterm_reaches_the_ranks_which_save_and_exit"),
    "Ctrl-C in a terminal": Case(covered_by="tests/training/test_training_resume.py::test_sigterm_saves_and_stops"),
    "kill -9 / OOM kill while a background save is written (`checkpoint.background`)": Case(
        covered_by="tests/training/test_training_resume.py::test_kill_during_save_keeps_previous_checkpoint"),
    "a background save's write fails (disk full, I/O error)": Case(
        covered_by="tests/training/test_training_faults.py::test_disk_full_during_save_keeps_the_previous_checkpoint"),
    "SIGTERM/SIGINT/SIGUSR1 while a background save is written": Case(
        covered_by="tests/training/test_training_hardening.py::test_sigterm_during_a_background_save_waits_for_the_write_then_exits_75"),
    "Slurm preemption / time limit": Case(
        covered_by="tests/launch/test_launch_scripts.py::test_usr1_reaches_the_ranks_and_spares_the_deepspeed_runner"),
    # issue 37 (third probe)
    "SIGTERM/SIGINT/SIGUSR1 during a checkpoint save": Case(
        covered_by="tests/training/test_training_hardening.py::test_sigterm_during_a_save_stops_after_it_without_another_step"),
    "SIGTERM/SIGINT/SIGUSR1 during start-up, before the first step": Case(
        covered_by="tests/training/test_training_hardening.py::test_sigterm_during_startup_exits_143_with_one_line"),
    "`srun python -m megaflex.train` with one GPU per task (`--gpus-per-task=1`)": Case(
        covered_by="tests/parallel/test_parallel_launcher_env.py::test_the_trainer_sets_the_device_from_local_rank_and_the_visible_count"),
    "Slurm allocates a node other GPUs than 0..slots-1 (a shared node), or another count": Case(
        covered_by="tests/launch/test_launch_scripts.py::test_train_sh_gives_the_ranks_slurms_gpus_not_the_hostfile_slots"),
    "two Slurm jobs whose first node is the same": Case(
        covered_by="tests/launch/test_launch_scripts.py::test_train_sh_takes_a_port_per_slurm_job"),
    "`megaflex-eval --checkpoint RUN_DIR --tag step_N`": Case(
        covered_by="tests/checkpoint/test_checkpoint_layout.py::test_eval_finds_a_tag_under_a_run_dir"),
    "`source launch/setup_env.sh` fails (offline: no wheels, or no suitable torch in `PYTHON`; a failed pip install)": Case(
        covered_by="tests/launch/test_launch_scripts.py::test_setup_sourced_keeps_the_callers_shell_options_and_never_exits_it"),
    "a retry after a failed `launch/setup_env.sh` attempt, or with another `PYTHON=`": Case(
        covered_by="tests/launch/test_setup_standin_image.py::test_a_failed_offline_attempt_leaves_nothing_and_the_recommended_python_is_honoured"),
    "a CUDA torch without triton in the node's Python": Case(
        covered_by="tests/launch/test_launch_scripts.py::test_node_packages_check_refuses_a_cuda_torch_without_triton"),
    "`launch/setup_env.sh` in a venv, conda env or system Python that already holds torch >= 2.11 (e.g. a GPU image whose `python3` is a virtualenv)": Case(
        covered_by="tests/launch/test_setup_standin_image.py::test_offline_setup_installs_into_a_layer_over_the_image_and_passes_pip_check"),
    "`launch/wheelhouse.sh --out` (a flag without its value)": Case(
        covered_by="tests/launch/test_wheelhouse.py::test_help_prints_the_usage_and_a_flag_without_its_value_is_one_line"),
    # --- Data and tokenizer faults
    "corrupt `.idx` (pointers shifted or inconsistent with the sizes, last pointer + size ≠ `.bin` length, bad document index)":
        Case(covered_by="tests/training/test_training_data_faults.py::test_training_on_shifted_pointers_fails_at_start_naming_the_file"),
    "token ids ≥ `model.vocab_size` in the data": Case(
        covered_by="tests/data/test_data_faults.py::test_token_ids_beyond_the_vocabulary_fail_on_open"),
    "`model.vocab_size` smaller than `data.tokenizer`'s (or the data card's) vocabulary": Case(
        lambda w, t, c: train(w["config"], f"logging.run_dir={t / 'run'}", "model.vocab_size=256"),
        "is smaller than the vocabulary of", slow=True),
    "`data.tokenizer` names a missing file": Case(
        lambda w, t, c: train(w["config"], f"logging.run_dir={t / 'run'}", f"data.tokenizer={t / 'missing.model'}"),
        "tokenizer model", slow=True),
    "`data.tokenizer` is not the tokenizer the data was made with (data card)": Case(
        covered_by="tests/data/test_data_faults.py::test_training_start_checks_tokenizer_file_vocab_and_data_cards"),
    "resuming a checkpoint made with another tokenizer": Case(
        covered_by="tests/training/test_training_data_faults.py::test_checkpoint_records_the_tokenizer_and_resume_refuses_another"),
    "`megaflex-eval` / `megaflex-generate` with another tokenizer (`--tokenizer`) or on data tokenized with another one":
        Case(covered_by="tests/data/test_data_faults.py::test_eval_refuses_a_tokenizer_or_data_other_than_the_checkpoints"),
    "malformed or binary YAML config": Case(_malformed_yaml, "malformed YAML (line 2, column 1)"),
    "truncated sample-index cache (`index_cache/*.npy`)": Case(
        covered_by="tests/data/test_data_faults.py::test_truncated_sample_index_cache_is_rebuilt_with_a_warning"),
    "first run on a large corpus: rank 0 builds the sample indices for longer than `parallel.timeout_minutes`": Case(
        covered_by="tests/training/test_training_index_build.py::test_an_index_build_longer_than_the_collective_timeout_is_waited_for"),
    "`data.cache_dir` unset": Case(
        covered_by="tests/data/test_data_faults.py::test_training_caches_sample_indices_next_to_the_data_by_default"),
    # issue 37
    "`data.tokenizer` is not a tokenizer megaflex reads (malformed `tokenizer.json`, a WordPiece file without an end-of-document token)":
        Case(_not_a_tokenizer, "tokenizer.json is not a tokenizers file", slow=True),
    "a lossy tokenizer (`decode(encode(text))` is not the text: a normalizer that drops newlines or lowercases, a model without byte fallback missing a character)":
        Case(_lossy_tokenizer, "unigram.json is lossy: decode(encode(text)) changes", slow=True),
    "`megaflex-eval --data F.jsonl` whose records lack the text field": Case(
        _jsonl_without_text, "docs.jsonl:1: no 'text' key in the JSON object (set --json-key)"),
    "`megaflex-eval --contexts … --mode stateful`": Case(
        lambda w, t, c: evaluate(["--checkpoint", str(w["run"]), "--data", str(w["root"] / "text.txt"),
                                  "--mode", "stateful", "--contexts", "16,32"], c),
        "--contexts: a context sweep needs --mode windows or sliding"),
    "`megaflex-eval` where bits per byte or word counts are unknown (no tokenizer; `--max-tokens`), or with `--contexts`": Case(
        covered_by="tests/training/test_failure_modes.py::test_eval_prints_the_context_sweep_and_no_unknown_numbers"),
    # --- Config, run-directory, resume, export and generation faults
    "non-finite or out-of-range float in the config (`train.lr=.inf`, `optimizer.beta1=1.5`, `optimizer.eps=.nan`, any float key)":
        Case(lambda w, t, c: train_in_process(["--config", str(w["config"]), "optimizer.beta1=1.5"], c),
             "config key 'optimizer.beta1' (from command line): expected a finite float in [0, 1), got 1.5"),
    "blend weights (`data.train_weights`) all zero": Case(_blend_zero, "expected at least one weight > 0"),
    "`model.feature_dim` odd for a trig feature map (or unknown `feature_kwargs`)": Case(
        lambda w, t, c: train_in_process(["--config", str(w["config"]), "model.feature_dim=33"], c),
        "model.feature_dim (from command line): feature_dim of attention='flexformer_n'"),
    # issue 45
    "`model.causal: false` given to `megaflex-train` / `megaflex-distill` (a language model that sees the token it predicts)":
        Case(lambda w, t, c: train_in_process(["--config", str(w["config"]), "model.causal=false"], c),
             "model.causal (from command line): false builds a bidirectional encoder"),
    "`megaflex-eval` / `megaflex-generate` of a bidirectional checkpoint (`model.causal: false`, trained before the refusal above)":
        Case(_bidirectional_checkpoint, "holds a bidirectional model (model.causal: false), which sees every token it is "
                                        "asked to predict: perplexity needs a causal language model"),
    "`model.causal: false` with a setting the attention plan refuses for it (`model.qkv_conv_size`, a gated `model.softmax_window`, `data.document_boundaries: reset`, `parallel.context_parallel_size` > 1)":
        Case(covered_by="tests/training/test_config_refusals.py::test_every_refusal_the_settings_decide_is_a_config_error"),
    "a count of 0 or less, `nan`/`inf`, a device this machine lacks or that does not exist (`--device cuda` on a CPU machine, `--device foo`), an output path that is an existing file or cannot be created, given to `megaflex-eval`/`-generate`/`-export`, the commands of `benchmarks/` or `studies/`; or as a config key (`train.global_batch_size=0`, `schedule.decay_iters=0`)":
        Case(covered_by="tests/test_entry_point_arguments.py::test_a_value_that_cannot_work_is_refused_while_parsing"),
    "HF `FlexformerForCausalLM` of a bidirectional model (`causal: false`): plain `model(ids)`": Case(
        covered_by="tests/hf/test_hf_model.py::test_a_bidirectional_model_answers_a_plain_call_and_refuses_to_generate"),
    "a fresh HF `FlexformerConfig()`": Case(covered_by="tests/hf/test_hf_model.py::test_a_fresh_config_has_model_config_defaults"),
    "the first screen of a run (the quick start)": Case(
        covered_by="tests/training/test_training_silent_settings.py::test_a_run_prints_each_warning_once"),
    "self-referential YAML alias (`a: &x {b: *x}`)": Case(_yaml_alias, "self-referential YAML alias at key 'train.again'"),
    "`schedule.decay_style=wsd` whose decay overlaps the warmup or rounds to no step (or a `schedule.wsd_*` key with another style)": Case(
        lambda w, t, c: train_in_process(["--config", str(w["config"]), "train.train_iters=10", "schedule.warmup_iters=3",
                                          "schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0.9"], c),
        "schedule.wsd_decay_fraction (from command line): the decay (9 of 10 iterations) overlaps the warmup"),
    "`logging.tensorboard` on (the default) but the `tensorboard` package not installed (a node's offline install)": Case(
        covered_by="tests/training/test_training_logging.py::test_missing_tensorboard_warns_and_logs_metrics_jsonl_only"),
    "`logging.wandb` set but the `wandb` package not installed": Case(
        covered_by="tests/training/test_training_logging.py::test_missing_wandb_is_a_one_line_config_error"),
    "a second run on a run directory a live run holds": Case(
        covered_by="tests/training/test_training_hardening.py::test_a_second_run_on_a_live_run_dir_exits_2_and_a_stale_lock_is_taken_over"),
    "a stale `run.lock` (its process is gone, same host)": Case(
        covered_by="tests/training/test_training_hardening.py::test_a_second_run_on_a_live_run_dir_exits_2_and_a_stale_lock_is_taken_over"),
    "resuming with another ZeRO stage (0 <-> 1/2 <-> 3; 1 <-> 2 loads)": Case(
        _resume_other_stage, "was saved with ZeRO stage 1, this run has parallel.zero_stage=3", slow=True),
    "resuming with another `train.precision` (fp32 <-> bf16)": Case(
        lambda w, t, c: train(w["config"], f"logging.run_dir={_copy_run(w, t)}", "train.precision=bf16", "train.train_iters=3"),
        "was saved with train.precision=fp32, this run has bf16", slow=True),
    "resuming a weights-only checkpoint (`megaflex-export --from-hf`)": Case(
        _resume_weights_only, "holds weights only (written by megaflex-export --from-hf", slow=True),
    # issue 37 (third probe)
    "resuming with another value of a model field, also one that keeps every shape (`model.position`, `model.norm_eps`, `model.rope_theta`, `model.attention`, …)":
        Case(_resume_other_position, "was trained with model.position=rope, this run has model.position=none;", slow=True),
    "resuming a checkpoint without `model.normalization` (trained with `rms`, the default before `capped_denominator`) under the new default":
        Case(_resume_without_normalization, "Set model.normalization=rms to continue this run, or start a new run", slow=True),
    "`data.eod_token_id` outside the vocabulary (`model.vocab_size`, or the tokenizer of a data card)": Case(
        lambda w, t, c: train_in_process(["--config", str(w["config"]), "data.document_boundaries=reset",
                                          "data.eod_token_id=512"], c),
        "config error: data.eod_token_id (from command line): expected an id in [0, model.vocab_size=512), got 512"),
    "`data.eod_token_id` set without `data.document_boundaries: reset`": Case(
        covered_by="tests/training/test_training_silent_settings.py::test_a_run_prints_each_warning_once"),
    "`model.window_mixing` set without `model.softmax_window`": Case(
        covered_by="tests/training/test_training_silent_settings.py::test_a_run_prints_each_warning_once"),
    "`data.document_boundaries: reset` on data tokenized without EODs (data card `append_eod: false`), or with a `data.eod_token_id` other than the card's EOD":
        Case(covered_by="tests/training/test_training_silent_settings.py::test_document_boundaries_are_checked_against_the_data_cards"),
    "a `logging.profile` window already past on resume": Case(
        covered_by="tests/training/test_training_silent_settings.py::test_a_run_prints_each_warning_once"),
    "`model.window_mixing: gated`, decoding a prompt shorter than the window": Case(
        covered_by="tests/attention/test_attention_hybrid.py::test_decoding_prompts_shorter_than_the_window_match_the_full_forward"),
    "`latest` holds undecodable bytes": Case(_undecodable_latest, "the quick"),
    "`data.split` leaves the validation split no documents": Case(
        lambda w, t, c: train(_indexed_config(w, t, split="999,1,0", tokenizer=None)),
        "the 'valid' split of", slow=True),
    "a directory, a symbolic-link loop or a broken link given as data": Case(
        _symlink_loop, "a.idx: is a symbolic link loop", slow=True),
    "a data card left from another preprocessing run beside a different `.idx`": Case(
        _stale_card, "a data card from another preprocessing run", slow=True),
    "`model.vocab_size` larger than the tokenizer's vocabulary (padded)": Case(_padded_vocab_generation, "the quick brown"),
    "one rank hung or frozen (SIGSTOP, dead NIC)": Case(
        covered_by="tests/training/test_training_hardening.py::test_a_frozen_peer_makes_the_others_exit_naming_step_and_collective"),
    "SIGTERM/SIGINT/SIGUSR1 during a long validation pass": Case(
        covered_by="tests/training/test_training_hardening.py::test_sigterm_during_a_long_validation_saves_promptly"),
    "`megaflex-export --hf-out DIR` (or `--megaflex-out DIR`) into a non-empty directory": Case(
        _non_empty_out, "the directory is not empty (holds README.md); pass --overwrite"),
    "`megaflex-export --from-hf … --megaflex-out` a training run's checkpoint folder or run directory": Case(
        lambda w, t, c: export(["--from-hf", str(w["hf"]), "--megaflex-out", str(w["ckpt"]), "--overwrite"], c),
        "refusing to write into a training run's checkpoint folder (it holds the training checkpoint"),
    "`megaflex-export --tag` of a missing step": Case(
        lambda w, t, c: export(["--checkpoint", str(w["run"]), "--tag", "step_00000007", "--hf-out", str(t / "o")], c),
        "tag: 'step_00000007' is not a complete checkpoint"),
    "`megaflex-export --from-hf DIR` with a missing weight shard": Case(
        _missing_shard, "model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing"),
    "truncated `megaflex.json` read by `megaflex-eval`/`megaflex-generate`/`megaflex-export`": Case(
        _truncated_meta, "megaflex.json: not valid JSON"),
    # issue 37
    "`model.attention_backend=triton` on CPU without `TRITON_INTERPRET=1` (or `fla` on CPU)": Case(
        _triton_on_cpu, "model.attention_backend (from command line): triton on CPU runs only under Triton's "
                        "interpreter: export TRITON_INTERPRET=1", slow=True),
    "`logging.run_dir` not writable (read-only file system, no write permission, a path under a regular file)": Case(
        _unwritable_run_dir, "/a_file/run is not writable: Not a directory; set logging.run_dir", slow=True),
    "`python -m megaflex.model.summary --memory` with a TP size that splits no heads, `--world`/`--micro-batch`/`--seq-len` < 1, or a `--seq-len` CP (x TP with `--sp`) cannot split": Case(
        covered_by="tests/model/test_memory_plan.py::test_impossible_plans_are_refused_with_one_line"),
    "HF `generate()` on right-padded prompts (as on left-padded ones)": Case(
        covered_by="tests/hf/test_hf_padding.py::test_padded_batch_generates_what_each_prompt_generates_alone"),
    "`logging.tensorboard: false`": Case(
        covered_by="tests/training/test_training_logging.py::test_last_line_names_the_tensorboard_folder_only_when_it_is_written"),
    # --- Encoder, benchmark and study faults (issue 45)
    "`classify --data FILE`: one `.jsonl` or `.tsv` instead of the task's folder": Case(
        covered_by="tests/training/test_classify_hardening.py::test_one_file_is_refused_not_used_as_train_valid_and_test"),
    "`classify --task text` on a folder without `valid.jsonl` (LRA's protocol: IMDb has no validation split)": Case(
        covered_by="tests/training/test_classify_hardening.py::test_text_selects_on_valid_jsonl_or_says_it_selects_on_test"),
    "`classify --out X` that cannot be created (under a file, no permission), or an argument that cannot work (`--steps 0`, `--eval-every 0`, `--lr nan`, `--device cuda` on a CPU machine, an unknown `--attention`)":
        Case(covered_by="tests/training/test_classify_hardening.py::test_values_that_cannot_work_are_refused_while_parsing"),
    "a long `classify` run": Case(
        covered_by="tests/training/test_classify_hardening.py::test_progress_with_an_eta_between_evaluations_and_truncation_per_split"),
    "Ctrl-C (SIGINT) during `classify`": Case(
        covered_by="tests/training/test_classify_hardening.py::test_sigint_writes_a_partial_result_and_exits_130_without_a_traceback"),
    "Ctrl-C during `python -m data_prep.listops`": Case(
        covered_by="tests/data_prep/test_listops.py::test_ctrl_c_leaves_no_tmp_file_and_no_partial_split"),
    "`benchmarks.lra_listops --out` a folder holding runs of other settings or data, or of an earlier version": Case(
        covered_by="tests/benchmarks/test_lra_listops.py::test_a_stored_run_is_reused_only_for_the_same_settings_and_data"),
    "a benchmark or study run without `--out`": Case(
        covered_by="tests/test_cli_args.py::test_no_benchmark_or_study_writes_a_committed_folder_by_default"),
    "the bidirectional window hybrid (`model.causal: false`, `model.softmax_window: W`) with padding between real tokens":
        Case(covered_by="tests/attention/test_attention_bidirectional.py::test_padding_between_real_tokens_changes_no_real_output"),
    "an encoder row without real tokens (all padding, or an empty document)": Case(
        covered_by="tests/model/test_encoder.py::test_a_row_without_real_tokens_pools_to_zeros"),
}


def test_every_documented_row_has_a_case_and_every_case_a_row() -> None:
    assert len(ROWS) >= 40 and {r.table for r in ROWS.values()} >= {"Launch and checkpoint faults",
                                                                     "Data and tokenizer faults"}
    assert sorted(set(ROWS) - set(CASES)) == [], "docs/training.md rows without a case in tests/training/test_failure_modes.py"
    assert sorted(set(CASES) - set(ROWS)) == [], "cases in tests/training/test_failure_modes.py without a docs/training.md row"
    for fault, case in CASES.items():
        assert (case.run is None) != (not case.covered_by), fault
        if case.covered_by:
            path, name = case.covered_by.split("::")
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{fault}: {case.covered_by} not found"


RUNNABLE = [pytest.param(fault, id=re.sub(r"\W+", "-", fault)[:60].strip("-"), marks=[pytest.mark.slow] if case.slow else [])
            for fault, case in CASES.items() if case.run is not None]


@pytest.mark.parametrize("fault", RUNNABLE)
@pytest.mark.usefixtures("forked_python")  # trainer faults: forked megaflex.train processes
def test_documented_fault(fault: str, world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    row, case = ROWS[fault], CASES[fault]
    outcome = case.run(world, tmp_path, capsys)
    assert outcome.returncode == row.status, f"{fault}: exit {outcome.returncode}, documented {row.status}\n" \
                                             f"{outcome.stderr[-3000:]}"
    if row.status == 0:
        assert "Traceback" not in outcome.stderr and "error:" not in outcome.stderr, outcome.stderr[-3000:]
        return
    line = one_error_line(outcome.stderr, outcome.prog)
    assert case.expect in line, f"{fault}: {case.expect!r} not in {line!r}"



def test_eval_prints_the_context_sweep_and_no_unknown_numbers(world: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Issue 37: the --contexts sweep reached only --json/--plot, and text without word counts
    (here cut by --max-tokens) printed "word ppl None"."""
    from megaflex.eval.perplexity import main

    out, data = tmp_path / "eval.json", world["root"] / "text.txt"
    capsys.readouterr()
    assert main(["--checkpoint", str(world["run"]), "--data", str(data), "--mode", "sliding", "--contexts", "16,32",
                 "--max-tokens", "400", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    results = json.loads(out.read_text())
    assert results["word_ppl"] is None and results["bits_per_byte"] is not None
    assert "None" not in "\n".join(lines) and "word ppl" not in "\n".join(lines), lines
    assert lines[0] == (f"{data}: ppl {results['ppl']:.3f} | tokens {results['tokens']:,} | "
                        f"bits/byte {results['bits_per_byte']:.4f} | mode sliding context 64")
    assert lines[1:] == [f"  context {r['context']} stride {r['stride']}: ppl {r['ppl']:.3f} | tokens {r['tokens']:,} | "
                         f"bits/byte {r['bits_per_byte']:.4f}" for r in results["context_sweep"]]
    assert [r["context"] for r in results["context_sweep"]] == [16, 32]
    # with word counts (the whole file), word ppl is printed
    assert main(["--checkpoint", str(world["run"]), "--data", str(data), "--max-docs", "1"]) == 0
    assert "| word ppl " in capsys.readouterr().out
