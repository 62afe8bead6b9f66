"""megaflex-eval / megaflex-generate on real checkpoints written by megaflex-train.

Three runs with the same seed and data: ZeRO-0 at TP=1 (one process), ZeRO-3 at TP=2 and ZeRO-2
at DP=2 (two gloo processes each). The learning rate is tiny, so both stay within ~lr of the same weights and any
mistake in ZeRO consolidation or TP resharding (a wrong shard, a permuted head) shows up as an
O(init) difference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from numerics import assert_params_close_after_adam
from training_harness import EVAL_LR, EVAL_STEPS, adam_steps_of, tiny_eval_train_args, tokenized_wikitext, train_rank
from megaflex.eval.eval_data import count_words
from megaflex.eval.loading import load_for_eval

REPO = Path(__file__).resolve().parents[2]


def _eval_rank(rank: int, world_size: int, args: list[str]) -> dict:
    from megaflex.eval.perplexity import run_cli as main

    return main(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval_cli")
    data = tokenized_wikitext(root / "data", shared_data, train_chars=150_000)
    out = {"data": data}
    out["z0"] = root / "z0"
    assert run_distributed(train_rank, 1, args=(tiny_eval_train_args(data, out["z0"], 0, 1),), init_process_group=False) == [0]
    out["z3tp2"] = root / "z3tp2"
    assert run_distributed(train_rank, 2, args=(tiny_eval_train_args(data, out["z3tp2"], 3, 2),),
                           init_process_group=False) == [0, 0]
    out["z2dp2"] = root / "z2dp2"  # ZeRO-2 partitions over two data-parallel ranks
    assert run_distributed(train_rank, 2, args=(tiny_eval_train_args(data, out["z2dp2"], 2, 1),),
                           init_process_group=False) == [0, 0]
    return out


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("other", ["z3tp2", "z2dp2"])
def test_zero_and_tp_checkpoints_load_as_the_same_model(runs: dict[str, Path], other: str) -> None:
    ref = load_for_eval(runs["z0"])
    a, b = ref.model.state_dict(), load_for_eval(runs[other]).model.state_dict()
    # both start from the same init and Adam moves each element by at most ~lr per step, whatever
    # the gradients (tests/numerics.py)
    lrs, betas, _, multiplier = adam_steps_of(ref)
    assert len(lrs) == EVAL_STEPS
    drift = assert_params_close_after_adam(b, a, lrs=lrs, betas=betas, lr_multiplier=multiplier, name=other)
    init_scale = max(a[n].std().item() for n in a if a[n].dim() == 2)
    assert init_scale > 1000 * drift  # so a misplaced shard could not pass the check above


@pytest.mark.slow
def test_megaflex_eval_json_contract_and_exact_counts(runs: dict[str, Path], tmp_path: Path) -> None:
    from megaflex.eval.perplexity import run_cli as main
    from megaflex.data.tokenizer import Tokenizer

    text_path = runs["data"] / "test.raw"
    text = text_path.read_text(encoding="utf-8")
    tok = Tokenizer(runs["data"] / "tok.model")
    out = {}
    for mode in ("windows", "sliding", "stateful"):
        json_path = tmp_path / f"{mode}.json"
        args = ["--checkpoint", str(runs["z0"]), "--data", str(text_path), "--mode", mode, "--context", "64",
                "--json", str(json_path)]
        main(args + (["--stride", "64"] if mode == "sliding" else []))
        out[mode] = json.loads(json_path.read_text())
    for mode, r in out.items():
        # the whole file is one document, [EOD] + tokens: every text token is a target, once
        assert r["tokens"] == len(tok.encode(text)), mode
        assert r["bytes"] == len(text.encode("utf-8")), mode
        assert r["words"] == count_words(text), mode
        assert r["ppl"] == pytest.approx(math.exp(r["mean_nll"]))
        assert r["bits_per_byte"] == pytest.approx(r["mean_nll"] * r["tokens"] / (math.log(2) * r["bytes"]))
        assert r["word_ppl"] == pytest.approx(math.exp(r["mean_nll"] * r["tokens"] / r["words"]), rel=1e-9)
    assert out["sliding"]["ppl"] == pytest.approx(out["windows"]["ppl"], rel=1e-9)  # stride == context


@pytest.mark.slow
def test_indexed_data_and_context_sweep_plot(runs: dict[str, Path], tmp_path: Path) -> None:
    from megaflex.eval.perplexity import run_cli as main
    from megaflex.data.indexed import IndexedDataset

    prefix = runs["data"] / "test"
    stored = IndexedDataset(prefix)
    total = sum(len(stored.document(i)) for i in range(stored.num_documents))
    png = tmp_path / "ppl.png"
    r = main(["--checkpoint", str(runs["z0"]), "--data", str(prefix), "--mode", "windows", "--context", "64",
              "--contexts", "16,32", "--plot", str(png)])
    assert r["tokens"] == total  # EOD prepended: every stored token (trailing EODs included) is a target
    assert [s["context"] for s in r["context_sweep"]] == [16, 32]
    assert all(s["tokens"] == total for s in r["context_sweep"])
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_distributed_eval_with_tp_and_dp_matches_one_process(runs: dict[str, Path]) -> None:
    from megaflex.eval.perplexity import run_cli as main

    # one document per line, so data-parallel ranks really split the documents
    args = ["--checkpoint", str(runs["z3tp2"]), "--data", str(runs["data"] / "test.raw"), "--mode", "stateful",
            "--context", "32", "--doc-mode", "line", "--max-docs", "30"]
    single = main(args)
    tp2 = run_distributed(_eval_rank, 2, args=(args + ["--tensor-parallel-size", "2"],), init_process_group=False)
    dp2 = run_distributed(_eval_rank, 2, args=(args,), init_process_group=False)
    for r in tp2 + dp2:
        assert r["tokens"] == single["tokens"]
        assert r["ppl"] == pytest.approx(single["ppl"], rel=1e-5)


@pytest.mark.slow
def test_megaflex_generate_streams_a_continuation(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    from megaflex.eval.generate import main

    main(["--checkpoint", str(runs["z0"]), "--prompt", " = Valkyria", "--max-new-tokens", "12", "--temperature", "0"])
    printed = capsys.readouterr().out
    assert printed.startswith(" = Valkyria")
    assert len(printed.rstrip("\n")) > len(" = Valkyria")


@pytest.mark.slow
def test_hf_dataset_source_tokenized_on_the_fly_matches_the_raw_file(runs: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from megaflex.eval.perplexity import run_cli as main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    text_path = runs["data"] / "test.raw"
    common = ["--checkpoint", str(runs["z0"]), "--mode", "stateful", "--context", "128"]
    raw = main(common + ["--data", str(text_path)])
    # HF's "text" loader yields the file's lines without newlines; "stream" joins them back
    hf = main(common + ["--data", f"hf:text:data_files={text_path}", "--doc-mode", "stream"])
    assert hf["tokens"] == raw["tokens"] and hf["bytes"] == raw["bytes"] and hf["words"] == raw["words"]
    assert hf["ppl"] == pytest.approx(raw["ppl"], rel=1e-9)


def test_console_entry_point_exits_zero(monkeypatch):
    """``megaflex-eval`` is ``sys.exit(main())``: main must return an exit status, not the results."""
    import megaflex.eval.perplexity as perplexity

    monkeypatch.setattr(perplexity, "run_cli", lambda argv=None: {"ppl": 1.0})
    assert perplexity.main([]) == 0


def test_results_json_is_written_without_matplotlib(tmp_path: Path) -> None:
    """A GPU node's offline install has no matplotlib (``megaflex[tools]``): megaflex-eval's JSON
    writer (megaflex.eval.plotting.write_json) must not need it; only a plot imports it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['matplotlib'] = None; from megaflex.eval.plotting import write_json; "
            "write_json(sys.argv[1], {'ppl': 1.5})")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.json")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text()) == {"ppl": 1.5}
