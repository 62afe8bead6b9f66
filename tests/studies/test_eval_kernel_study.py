"""The kernel study v2: a real smoke run over three sessions (resume, --only, --order, --fresh;
real data, a kind and an arm, two seeds, a few steps), run order and fingerprints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dataclasses import replace

from studies.kernel_study import main, plan, run_study
from studies.kernel_study_config import RunSpec, StudyConfig
from studies.runner import load_row, run_fingerprint, save_row
from studies.kernel_study_report import aggregate, arm_comparisons, chi_density, window_targets
from studies.paired_stats import compare_runs


TINY = ["--steps", "3", "--kinds", "flexformer_n", "--arms", "fn_hybrid", "--seeds", "2",
        "--max-train-docs", "40", "--vocab-size", "512", "--hidden-size", "32", "--num-layers", "2",
        "--num-heads", "2", "--feature-dim", "16", "--seq-len", "64", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--eval-tokens", "600", "--tokenizer-sentences", "5000"]


@pytest.mark.slow
@pytest.mark.usefixtures("forked_python")  # its training runs: forked, not fresh interpreters
def test_kernel_study_resumes_across_sessions_and_writes_seed_aggregates(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*TINY, "--data-root", str(shared_data), "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    # session 1: only the hybrid arm; the report is partial and names the missing runs
    rows = main([*argv, "--only", "fn_hybrid"])
    assert [(r["label"], r["seed"]) for r in rows] == [("fn_hybrid", 1234), ("fn_hybrid", 1235)]
    partial = json.loads((out / "results.json").read_text())
    assert partial["complete"] is False and partial["missing"] == ["flexformer_n_s1234", "flexformer_n_s1235"]
    md = (out / "results.md").read_text()
    assert "Partial report: 2 of 4 runs missing" in md and "flexformer_n_s1235" in md
    hybrid_files = {p.name: p.read_bytes() for p in (out / "runs").glob("fn_hybrid_s*.json")}
    assert sorted(hybrid_files) == ["fn_hybrid_s1234.json", "fn_hybrid_s1235.json"]
    assert (tmp_path / "work" / "runs" / "fn_hybrid_s1234" / "checkpoints").is_dir()  # kept for reuse

    # session 2: the stored hybrid runs are skipped (files untouched), the rest is trained
    rows = main([*argv, "--order", "kinds"])
    assert [(r["label"], r["seed"]) for r in rows] == [
        (label, seed) for seed in (1234, 1235) for label in ("flexformer_n", "fn_hybrid")
    ]
    assert {p.name: (out / "runs" / p.name).read_bytes() for p in (out / "runs").glob("fn_hybrid_s*.json")} == hybrid_files
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True and results["missing"] == []
    assert results["tokens_per_run"] == 3 * 2 * 64
    for run in results["runs"]:
        for key in ("english_docs_valid_ppl", "wikitext2_test_ppl", "english_docs_valid_bpb", "train_tokens_per_s"):
            assert math.isfinite(run[key]) and run[key] > 0, (run["label"], key)
        assert run["english_docs_valid_tokens"] == run["wikitext2_test_tokens"] == 599  # capped sets, EOD first
        # an untrained model over a 512-token vocabulary is near-uniform, never better than ~e^4
        assert 50 < run["english_docs_valid_ppl"] < 5000
        assert len(run["effective_keys"]) == 2  # the trainer's probe statistics, per layer
        assert len(run["q_norm_mean"]) == len(run["k_norm_p90"]) == 2 and min(run["q_norm_p90"]) > 0
    by_label = {s["label"]: s for s in results["summary"]}
    assert by_label["fn_hybrid"]["seeds"] == 2 and by_label["fn_hybrid"]["english_docs_valid_ppl_std"] > 0
    runs = {(r["label"], r["seed"]): r for r in results["runs"]}
    assert len(runs["flexformer_n", 1234]["tau_per_layer"]) == 2
    assert runs["flexformer_n", 1235]["omega_rel_change"][0] > 0  # Omega trained
    assert "model.softmax_window=64" in runs["fn_hybrid", 1234]["overrides"]
    md = (out / "results.md").read_text()
    assert "All runs of the study are in" in md and "| fn_hybrid | 2 |" in md and "± " in md and "## Verdict" in md
    assert "## Per layer" in md and "## Each arm against its control" in md
    for png in ("loss_curves.png", "spectrum.png", "tau.png"):
        assert (out / png).stat().st_size > 5000

    # session 3: --fresh retrains the selected run (new file); the other rows still feed the report
    stored = (out / "runs" / "flexformer_n_s1234.json").read_bytes()
    rows = main([*argv, "--only", "flexformer_n", "--seeds", "1", "--fresh"])
    assert [(r["label"], r["seed"]) for r in rows] == [("flexformer_n", 1234), ("fn_hybrid", 1234)]
    assert (out / "runs" / "flexformer_n_s1234.json").read_bytes() != stored
    assert {p.name: (out / "runs" / p.name).read_bytes() for p in (out / "runs").glob("fn_hybrid_s*.json")} == hybrid_files


def test_run_order_and_only() -> None:
    cfg = StudyConfig(kinds=["softmax", "elu"], arms=["fn_hybrid"], seeds=2)
    runs = cfg.runs()
    seed_major = [(r.label, s) for r, s in plan(cfg, runs, "seeds")]
    kind_major = [(r.label, s) for r, s in plan(cfg, runs, "kinds")]
    assert seed_major == [(label, s) for s in (1234, 1235) for label in ("softmax", "elu", "fn_hybrid")]
    assert kind_major == [(label, s) for label in ("softmax", "elu", "fn_hybrid") for s in (1234, 1235)]
    with pytest.raises(ValueError, match="order"):
        plan(cfg, runs, "random")
    with pytest.raises(ValueError, match=r"only: .*unknown \['cosformer'\]"):
        run_study(cfg, runs, "cmd", only=["cosformer"])
    with pytest.raises(SystemExit):
        main(["--order", "random"])


def test_report_only_rewrites_the_report_from_stored_rows_without_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import studies.kernel_study as study

    monkeypatch.setattr(study, "prepare_data", lambda cfg: pytest.fail("--report-only must not prepare data"))
    argv = ["--kinds", "softmax,elu", "--arms", "", "--seeds", "2", "--out", str(tmp_path)]
    cfg = study.config_from_args(study.build_parser().parse_args(argv))
    for label, base in (("softmax", 200.0), ("elu", 230.0)):
        for seed, jitter in ((1234, 0.0), (1235, 9.0)):
            row = {"label": label, "kind": label, "seed": seed, "english_docs_valid_ppl": base + jitter,
                   "wikitext2_test_ppl": 2 * base + jitter, "loss_curve": [(5, 6.0), (10, 5.0)]}
            save_row(cfg, RunSpec(label, label), seed, row, "training command")
    rows = main([*argv, "--report-only"])
    assert len(rows) == 4
    md = (tmp_path / "results.md").read_text()
    assert "All runs of the study are in." in md and "--report-only" not in md
    assert f"Command (latest session): `python -m studies.kernel_study --kinds softmax,elu --arms '' --seeds 2 --out {tmp_path}`" in md
    with pytest.raises(ValueError, match="--report-only: expected neither --fresh nor --reuse-from"):
        main([*argv, "--report-only", "--fresh"])


def test_v5_arm_sets_and_the_1024_token_preset() -> None:
    from studies.kernel_study import build_parser, config_from_args
    from studies.kernel_study_config import ARM_SETS, ARMS, PRESETS

    assert all(arm in ARMS for arms in ARM_SETS.values() for arm in arms)
    cfg = config_from_args(build_parser().parse_args(["--arms", "v5_controls,fn_qk_rms,v5_remedies"]))
    assert cfg.arms[:2] == ["softmax_window16", "softmax_window64"] and cfg.arms.count("fn_qk_rms") == 1
    assert set(cfg.arms) == set(ARM_SETS["v5_controls"]) | set(ARM_SETS["v5_remedies"])
    long = config_from_args(build_parser().parse_args(["--preset", "cpu1024"]))
    assert long.seq_len == 1024 and long.tokens_per_run == StudyConfig().tokens_per_run  # the same tokens per run
    assert long.global_batch_size * long.seq_len == StudyConfig().global_batch_size * StudyConfig().seq_len
    assert set(PRESETS["cpu1024"]) == {"seq_len", "micro_batch_size", "global_batch_size"}  # the model is the cpu one


def test_fingerprint_covers_settings_overrides_and_seed_not_selection(tmp_path: Path) -> None:
    cfg = StudyConfig(out=str(tmp_path))
    run = RunSpec("fn_hybrid", "flexformer_n", ["model.softmax_window=64"])
    digest = run_fingerprint(cfg, run, 1234)["digest"]
    # selecting other runs or other places does not change what this run computes
    for changed in (dict(kinds=["elu"]), dict(arms=[]), dict(seeds=1), dict(out="elsewhere"), dict(work_dir="w")):
        assert run_fingerprint(replace(cfg, **changed), run, 1234)["digest"] == digest, changed
    for changed in (dict(lr=1e-3), dict(steps=301), dict(feature_dim=32), dict(seed=1), dict(eval_tokens=0)):
        assert run_fingerprint(replace(cfg, **changed), run, 1234)["digest"] != digest, changed
    assert run_fingerprint(cfg, run, 1235)["digest"] != digest
    assert run_fingerprint(cfg, RunSpec("fn_hybrid", "flexformer_n", ["model.softmax_window=32"]), 1234)["digest"] != digest
    # a stored row is used only under the same fingerprint
    row = {"label": "fn_hybrid", "kind": "flexformer_n", "seed": 1234, "english_docs_valid_ppl": 300.0}
    save_row(cfg, run, 1234, row, "cmd")
    assert load_row(cfg, run, 1234) == row
    assert load_row(replace(cfg, lr=1e-3), run, 1234) is None
    assert load_row(cfg, run, 1235) is None


def test_aggregate_and_the_paired_seed_rule() -> None:
    rows = [{"label": "a", "kind": "elu", "seed": s, "english_docs_valid_ppl": v, "wikitext2_test_ppl": v + 1}
            for s, v in enumerate((10, 12, 14))]
    rows += [{"label": "b", "kind": "elu", "seed": s, "english_docs_valid_ppl": v, "wikitext2_test_ppl": v}
             for s, v in enumerate((20, 21, 22))]
    a, b = aggregate(rows)
    assert a["english_docs_valid_ppl_mean"] == pytest.approx(12.0) and a["english_docs_valid_ppl_std"] == pytest.approx(2.0)
    assert compare_runs(rows, "a", "b", "english_docs_valid_ppl").a_better is True
    assert compare_runs(rows, "b", "a", "english_docs_valid_ppl").a_better is False
    # 12 +- 2 vs 13 +- 1: the means are 1.3 SE apart (noise for an unpaired test), but c is 1-3 ppl
    # above a on every seed in the same order: paired, the log-ratios 0.47, 0.08, -0.07 (%) do not separate
    close = [{**r, "label": "c", "english_docs_valid_ppl": r["english_docs_valid_ppl"] + d}
             for r, d in zip(rows[:3], (3.0, 1.0, -1.0))]
    assert compare_runs(rows + close, "a", "c", "english_docs_valid_ppl").a_better is None
    single = aggregate(rows[:1])[0]
    assert single["english_docs_valid_ppl_std"] is None
    assert compare_runs(rows[:1] + rows[3:], "a", "b", "english_docs_valid_ppl").method == "none"


def test_window_targets_compare_each_hybrid_with_its_own_controls() -> None:
    def runs(label: str, kind: str, valid: tuple[float, ...]) -> list[dict]:
        return [{"label": label, "kind": kind, "seed": s, "english_docs_valid_ppl": v, "wikitext2_test_ppl": 2 * v}
                for s, v in enumerate(valid)]

    rows = runs("softmax", "softmax", (100, 101, 102)) + runs("fn_window64", "flexformer_n", (108, 109, 110))
    rows += runs("softmax_window64", "softmax", (120, 121, 122)) + runs("performer_window64", "performer", (100, 110, 120))
    rows += runs("fn_window16", "flexformer_n", (130, 131, 132)) + runs("softmax_window16", "softmax", (125, 126, 127))
    rows += runs("fn_window16_capped", "flexformer_n", (103, 104, 105)) + runs("performer_window16_capped", "performer", (150, 151, 152))
    lines = window_targets(aggregate(rows), rows)
    assert len(lines) == 6  # three hybrids (by W, then name) x two eval sets
    w16, w16_wiki, capped, _, w64, _ = lines
    assert w16.startswith("- english-docs valid, fn_window16 (W=16) 131.0: 1.30x softmax (target <= 1.10: missed; worse than softmax (")
    assert capped.startswith("- english-docs valid, fn_window16_capped (W=16) 104.0: 1.03x softmax (target <= 1.10: met")
    assert "better than performer_window16_capped (" in capped and "better than fn_window16 (" in capped
    assert "worse than softmax_window16 (" in w16 and "performer_window16" not in w16 and "fn_gated16" not in w16
    assert "WikiText-2 test" in w16_wiki
    assert "1.08x softmax (target <= 1.10: met" in w64 and "better than softmax_window64 (" in w64
    # 109 +- 1 vs 110 +- 10 over 3 seeds: the per-seed log-ratios (+8.6%, -0.9%, -8.7%) do not separate
    assert "not separated from performer_window64 (" in w64 and "paired n=3" in w64
    assert window_targets(aggregate(runs("softmax", "softmax", (1, 2))), runs("softmax", "softmax", (1, 2))) == []


def test_remedy_arms_are_compared_with_their_control_and_the_window_alone() -> None:
    def runs(label: str, kind: str, valid: tuple[float, ...]) -> list[dict]:
        return [{"label": label, "kind": kind, "seed": s, "english_docs_valid_ppl": v, "wikitext2_test_ppl": v}
                for s, v in enumerate(valid)]

    rows = (runs("flexformer_n", "flexformer_n", (240, 230, 250)) + runs("fn_tied_eta0.5", "flexformer_n", (236, 226, 246))
            + runs("fn_window64_capped", "flexformer_n", (222, 215, 228)) + runs("softmax_window64", "softmax", (217, 212, 224))
            + runs("fn_window64_capped_far_gain", "flexformer_n", (220, 214, 226)))
    table = {r["arm"]: r for r in arm_comparisons(aggregate(rows), rows)}
    assert table["fn_tied_eta0.5"]["control"] == "flexformer_n"
    assert table["fn_tied_eta0.5"]["english-docs valid"].endswith(": better than control")  # ~1.7% below on every seed
    assert table["fn_window64_capped_far_gain"]["control"] == "fn_window64_capped"  # the hybrid it changes
    assert "softmax_window64" not in table and "flexformer_n" not in table  # a kind, and a control of the kind softmax absent
    w64 = window_targets(aggregate(rows), rows)[0]
    assert "worse than softmax_window64 (" in w64  # the window alone, 1.2-2.3% below the hybrid on every seed
    gain = [line for line in window_targets(aggregate(rows), rows) if "fn_window64_capped_far_gain (W=64)" in line][0]
    assert "softmax_window64 (" in gain and "fn_window64_capped (" in gain and "performer_window64_capped" not in gain


def test_probe_norms_are_carried_per_layer_into_rows_and_the_report() -> None:
    from studies.kernel_study_report import per_layer_table
    from studies.runner import kernel_summary

    records = {10: {f"layer0{i}/{key}": value + i for i in (0, 1) for key, value in
                    (("effective_keys", 100.0), ("q_norm_mean", 5.0), ("q_norm_p90", 7.0), ("k_norm_mean", 3.0),
                     ("k_norm_p90", 4.0))}}
    summary = kernel_summary(records, 2)
    assert summary["q_norm_mean"] == [5.0, 6.0] and summary["k_norm_p90"] == [4.0, 5.0]
    assert kernel_summary({}, 2)["q_norm_p90"] is None
    rows = [{"label": "a", "kind": "elu", "seed": s, "english_docs_valid_ppl": 10.0, "wikitext2_test_ppl": 10.0,
             **{k: [v + s for v in values] for k, values in summary.items() if k != "tau_curve" and values}}
            for s in (0, 2)]
    rows.append({"label": "old", "kind": "elu", "seed": 0, "english_docs_valid_ppl": 10.0, "wikitext2_test_ppl": 10.0,
                 "effective_keys": [50.0, 60.0]})  # stored before the norms were logged
    table = {r["run"]: r for r in per_layer_table(aggregate(rows))}
    assert table["a"] == {"run": "a", "effective keys": "101.0 / 102.0", "‖q‖ mean (p90)": "6.00 (8.00) / 7.00 (9.00)",
                          "‖k‖ mean (p90)": "4.00 (5.00) / 5.00 (6.00)"}  # mean over the seeds 0 and 2: +1
    assert table["old"]["effective keys"] == "50.0 / 60.0" and table["old"]["‖q‖ mean (p90)"] == "-"


def test_chi_density_integrates_to_one_with_the_right_mean() -> None:
    import torch

    x = torch.linspace(1e-4, 20, 200001)
    dx = float(x[1] - x[0])
    for k in (1, 4, 32):
        pdf = chi_density(x, k)
        assert float(pdf.sum() * dx) == pytest.approx(1.0, abs=1e-3)
        mean = float((x.double() * pdf).sum() * dx)
        expected = math.sqrt(2) * math.exp(math.lgamma((k + 1) / 2) - math.lgamma(k / 2))
        assert mean == pytest.approx(expected, rel=1e-3)


def test_runs_use_the_project_kernel_lr_multipliers_and_arms_override_them(tmp_path: Path) -> None:
    from studies.kernel_study_config import ARMS, REPO
    from studies.runner import train_overrides
    from megaflex.training.config import OptimizerConfig, load_config

    cfg = StudyConfig()
    data = {"train": tmp_path / "train", "valid": tmp_path / "valid", "tokenizer": tmp_path / "tok.model"}
    base = REPO / "configs" / "tiny.yaml"  # sets both multipliers to 1 for the quick start
    project = OptimizerConfig()

    def optimizer_of(run: RunSpec):
        return load_config([base], train_overrides(cfg, run, 1234, data, tmp_path / "run")).optimizer

    default = optimizer_of(RunSpec("flexformer_n", "flexformer_n"))
    assert default.kernel_frequency_lr_multiplier == project.kernel_frequency_lr_multiplier
    assert default.kernel_temperature_lr_multiplier == project.kernel_temperature_lr_multiplier
    off = optimizer_of(RunSpec("fn_kernel_lr_off", "flexformer_n", list(ARMS["fn_kernel_lr_off"][0])))
    assert off.kernel_frequency_lr_multiplier == off.kernel_temperature_lr_multiplier == 1.0
    assert project.kernel_frequency_lr_multiplier != 1.0  # else the arm would equal the default


def test_v3_arms_build_valid_models_and_report_the_far_share_per_layer() -> None:
    import torch

    from studies.runner import kernel_summary
    from studies.kernel_study_config import ARM_KINDS, ARMS, V3_ARMS
    from megaflex.model import GPT, ModelConfig

    kinds = {}
    for arm in V3_ARMS:
        values = {"vocab_size": 64, "num_layers": 1, "hidden_size": 16, "num_heads": 2, "feature_dim": 8,
                  "chunk_size": 8, "attention": ARM_KINDS.get(arm, "flexformer_n")}
        for override in ARMS[arm][0]:
            key, value = override.removeprefix("model.").split("=")
            values[key] = int(value) if value.isdigit() else value
        model = GPT(ModelConfig(**values)).eval()  # every arm is a valid model and runs
        stats = model.kernel_statistics(torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0)))
        kinds[arm] = (values["attention"], values.get("window_mixing"), stats.get("layer00/far_share"))
    assert kinds["softmax_window16"][:2] == ("softmax", None) and kinds["softmax_window16"][2] == 0.0
    assert kinds["performer_window16"][:2] == ("performer", "shared_normaliser") and kinds["performer_window16"][2] > 0
    assert kinds["fn_gated64"][1] == "gated" and kinds["fn_gated64"][2] is None  # the gate's branches: no far field
    assert kinds["fn_window16"][2] > 0 and kinds["fn_window64"][2] is None  # 20 probe tokens < W = 64: no far field

    records = {10: {"layer00/far_share": 0.2, "layer01/far_share": 0.6}}
    assert kernel_summary(records, 2)["far_share"] == [0.2, 0.6]
    rows = [{"label": "fn_window16", "kind": "flexformer_n", "seed": s, "english_docs_valid_ppl": 100.0 + s,
             "wikitext2_test_ppl": 200.0, "far_share": [0.1 * s, 0.5]} for s in (1, 2)]
    (summary,) = aggregate(rows)
    assert summary["far_share_per_layer"] == pytest.approx([0.15, 0.5]) and summary["far_share_mean"] == pytest.approx(0.325)


def test_every_arm_is_a_valid_run_config_whose_model_runs() -> None:
    """Each arm's overrides, as the runner passes them to megaflex-train (configs/tiny.yaml first), load
    as a valid config, and the model they build runs a probe batch with finite logits."""
    import torch

    from megaflex.model import GPT
    from megaflex.training.config import load_config
    from studies.kernel_study_config import ARMS, REPO
    from studies.runner import train_overrides

    cfg = StudyConfig(vocab_size=64, num_layers=1, hidden_size=64, num_heads=2, feature_dim=8, seq_len=80, arms=list(ARMS))
    data = {"train": Path("unused/train"), "valid": Path("unused/valid"), "tokenizer": Path("unused/tok.model")}
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(0))
    for run in cfg.runs():
        if run.label not in ARMS:
            continue
        config = load_config([REPO / "configs" / "tiny.yaml"], train_overrides(cfg, run, 1234, data, Path("unused/run")))
        torch.manual_seed(0)
        logits = GPT(config.model).eval()(ids).logits
        assert torch.isfinite(logits).all(), run.label
    with pytest.raises(ValueError, match=r"--arms: \['fn_tau_max0.5'\] set temperatures computed for head dim 32"):
        replace(cfg, hidden_size=32, arms=["fn_tau_max0.5", "fn_tied_eta0.5"]).runs()


def test_the_base_normalisation_is_fingerprinted_only_where_it_changes_the_run(tmp_path: Path) -> None:
    from studies.kernel_study_config import REPO
    from studies.runner import train_overrides
    from megaflex.training.config import load_config

    capped, rms = StudyConfig(out=str(tmp_path)), StudyConfig(out=str(tmp_path), normalization="rms")
    assert capped.normalization == "capped_denominator"  # the project default: every run gets it unless an arm sets one

    def digest(cfg: StudyConfig, run: RunSpec) -> str:
        return run_fingerprint(cfg, run, 1234)["digest"]

    plain = RunSpec("flexformer_n", "flexformer_n")
    assert digest(capped, plain) != digest(rms, plain)  # another normaliser, another run
    # "rms" is v1-v3's implicit base: those rows keep their fingerprints (no normalization key)
    assert "normalization" not in run_fingerprint(rms, plain, 1234)["settings"]
    for unaffected in (RunSpec("softmax", "softmax"), RunSpec("fn_capped", "flexformer_n", ["model.normalization=capped_denominator"])):
        assert digest(capped, unaffected) == digest(rms, unaffected), unaffected.label
    window = RunSpec("softmax_window16", "softmax", ["model.softmax_window=16"])  # the hybrid path normalises
    assert digest(capped, window) != digest(rms, window)
    data = {"train": tmp_path / "train", "valid": tmp_path / "valid", "tokenizer": tmp_path / "tok.model"}

    def normalization(cfg: StudyConfig, run: RunSpec) -> str:
        return load_config([REPO / "configs" / "tiny.yaml"], train_overrides(cfg, run, 1234, data, tmp_path / "r")).model.normalization

    assert normalization(rms, plain) == "rms" and normalization(capped, plain) == "capped_denominator"
    assert normalization(rms, RunSpec("fn_capped", "flexformer_n", ["model.normalization=capped_denominator"])) == "capped_denominator"


def test_reuse_copies_rows_of_another_study_with_the_same_recipe_under_this_studys_labels(tmp_path: Path) -> None:
    from studies.runner import reuse_rows

    old = StudyConfig(out=str(tmp_path / "v3"), normalization="rms", seeds=1)
    stored = {  # label -> (run of the old study, its row)
        "fn_capped": RunSpec("fn_capped", "flexformer_n", ["model.normalization=capped_denominator"]),
        "flexformer_n": RunSpec("flexformer_n", "flexformer_n"),  # rms then: not the new default's recipe
        "softmax": RunSpec("softmax", "softmax"),
    }
    for label, run in stored.items():
        save_row(old, run, 1234, {"label": label, "english_docs_valid_ppl": float(len(label))}, f"cmd {label}")
    new = StudyConfig(out=str(tmp_path / "v4"), kinds=["softmax", "flexformer_n", "elu"], arms=[], seeds=1)
    copied = reuse_rows(new, new.runs(), tmp_path / "v3")
    assert sorted(copied) == ["flexformer_n_s1234", "softmax_s1234"]
    fn = load_row(new, RunSpec("flexformer_n", "flexformer_n"), 1234)  # under the new fingerprint: it loads
    assert fn["english_docs_valid_ppl"] == float(len("fn_capped")) and fn["label"] == "flexformer_n"
    assert fn["reused_from"].endswith("fn_capped_s1234.json")
    assert load_row(new, RunSpec("elu", "elu"), 1234) is None
    assert reuse_rows(new, new.runs(), tmp_path / "v3") == []  # stored rows are never overwritten


def test_long_context_columns_score_past_the_training_length_or_name_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import studies.runner as study
    from megaflex.eval.scoring import evaluate
    from megaflex.model import GPT, ModelConfig

    assert study.long_context_scores(StudyConfig(), None, None, None) == {}  # off by default
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in (150, 90, 40)]
    monkeypatch.setattr(study, "eval_documents", lambda path, tok, max_tokens: docs)
    cfg = StudyConfig(seq_len=32, eval_batch_size=4, long_contexts=[64, 128])
    shape = dict(vocab_size=64, num_layers=1, hidden_size=16, num_heads=2, feature_dim=8, chunk_size=8, max_seq_len=32)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**shape, attention="flexformer_n")).eval()
    scores = study.long_context_scores(cfg, model, None, None)
    assert scores["long_context_errors"] == {}
    for context in (64, 128):  # 2x and 4x the training length, as scoring computes it
        assert scores[f"english_docs_valid_ppl_windows{context}"] == evaluate(model, docs, "windows", context).ppl
    # stateful scoring carries the state through each whole document, so it is scored once, at the longest
    # context: the chunk length changes only rounding
    assert "english_docs_valid_ppl_stateful64" not in scores
    assert scores["english_docs_valid_ppl_stateful128"] == evaluate(model, docs, "stateful", 128).ppl
    assert scores["english_docs_valid_ppl_stateful128"] == pytest.approx(evaluate(model, docs, "stateful", 64).ppl, rel=1e-6)
    cosformer = GPT(ModelConfig(**shape, attention="cosformer")).eval()  # its reweighting ends at max_seq_len
    scores = study.long_context_scores(cfg, cosformer, None, None)
    assert scores["english_docs_valid_ppl_windows64"] is None
    assert "max_seq_len=32" in scores["long_context_errors"]["english_docs_valid_ppl_windows64"]


def test_normalizer_diagnosis_measures_the_gain_rms_puts_on_softmax_attention() -> None:
    import torch

    from studies.normalizer_diagnosis import capture_attention_inputs, init_gradient_scale, rms_gain_statistics
    from megaflex.model import GPT, ModelConfig

    # equal keys: uniform causal attention, so A v at position t is the mean of the first t values
    gen = torch.Generator().manual_seed(0)
    n, d = 64, 8
    q, k = torch.zeros(1, 1, n, d), torch.zeros(1, 1, n, d)
    v = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
    stats = rms_gain_statistics(q, k, v, eps=0.0)
    means = v.cumsum(-2) / torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    gain = 1 / means.pow(2).mean(-1).sqrt().flatten()
    assert stats["by_position"]["1-1"]["median"] == pytest.approx(gain[0].item(), rel=1e-12)
    assert stats["by_position"]["17-64"]["median"] == pytest.approx(gain[16:].median().item(), rel=1e-12)
    # averaging t unit-variance values shrinks their RMS ~ 1/sqrt(t): rms multiplies late outputs more
    assert stats["by_position"]["17-64"]["median"] > 3 * stats["by_position"]["1-1"]["median"]
    assert stats["by_position"]["17-64"]["effective_keys_median"] == pytest.approx(40.5, abs=0.51)

    config = ModelConfig(vocab_size=64, num_layers=2, hidden_size=16, num_heads=2, attention="softmax", max_seq_len=32)
    tokens = torch.randint(0, 64, (2, 17), generator=gen)
    captured = capture_attention_inputs(GPT(config).eval(), tokens[:, :-1])
    assert len(captured) == 2 and all(t.shape == (2, 2, 16, 8) for qkv in captured for t in qkv)
    grads = init_gradient_scale(ModelConfig(**{**config.to_dict(), "attention": "flexformer_n", "feature_dim": 8}), tokens, 0)
    assert set(grads) == {"rms", "capped_denominator"}
    assert all(len(g["qkv_grad_norm"]) == 2 and min(g["qkv_grad_norm"]) > 0 for g in grads.values())


def test_v4_verdict_asks_whether_each_learned_kernel_beats_every_fixed_one_and_tabulates_long_context() -> None:
    from studies.kernel_study_report import learned_against_fixed, long_context_metrics, long_context_table

    def rows(label: str, kind: str, ppls: tuple[float, ...], long: float | None = None) -> list[dict]:
        out = []
        for seed, ppl in enumerate(ppls):
            row = {"label": label, "kind": kind, "seed": seed, "english_docs_valid_ppl": ppl, "wikitext2_test_ppl": ppl}
            if long is not None and seed == 0:  # one seed scored at long context
                row |= {"english_docs_valid_ppl_windows1024": long * 0.9, "english_docs_valid_ppl_stateful1024": long}
            out.append(row)
        return out

    all_rows = (rows("softmax", "softmax", (200, 202, 204), long=220.0) + rows("flexformer_n", "flexformer_n", (230, 231, 232), long=230.0)
                + rows("performer", "performer", (260, 262, 264)) + rows("elu", "elu", (229, 233, 237)))
    lines = learned_against_fixed(aggregate(all_rows), all_rows)
    assert lines[0].startswith("- english-docs valid: does flexformer_n (231.0) beat every fixed kernel (paired t)? no "
                               "(not separated from elu (") and "performer" not in lines[0]
    without_elu = [r for r in all_rows if r["label"] != "elu"]
    assert learned_against_fixed(aggregate(without_elu), without_elu)[0].endswith("(paired t)? yes.")
    metrics = long_context_metrics(all_rows)
    assert metrics == ["english_docs_valid_ppl_windows1024", "english_docs_valid_ppl_stateful1024"]
    table = {r["run"]: r for r in long_context_table(all_rows, metrics, "english_docs_valid_ppl")}
    assert sorted(table) == ["flexformer_n", "softmax"]  # rows without the columns are left out
    fn = table["flexformer_n"]
    assert fn["n"] == 1 and fn["at training length"] == "230.00"  # the scored seed's own training-length ppl
    assert fn["stateful1024 / training length"] == "1.000" and fn["stateful1024 / softmax"] == f"{230 / 220:.3f}"
    assert table["softmax"]["windows 1024"] == "198.00"


def test_each_recipe_meets_the_fixed_kernel_it_starts_from_under_the_same_setting() -> None:
    from studies.kernel_study_report import learned_against_its_fixed_kernel

    def runs(label: str, kind: str, valid: tuple[float, ...]) -> list[dict]:
        return [{"label": label, "kind": kind, "seed": s, "english_docs_valid_ppl": v, "wikitext2_test_ppl": v}
                for s, v in enumerate(valid)]

    rows = (runs("performer", "performer", (240, 232, 236)) + runs("flexformer_n", "flexformer_n", (246, 238, 242))
            + runs("fn_decay", "flexformer_n", (226, 219, 222)) + runs("fn_window64_capped", "flexformer_n", (226, 220, 224)))
    lines = learned_against_its_fixed_kernel(aggregate(rows), rows)
    docs = [line for line in lines if line.startswith("- english-docs valid")]
    assert len(docs) == 2 and not any("fn_window64_capped" in line for line in lines)  # hybrids: window_targets
    plain, decay = docs
    assert plain.startswith("- english-docs valid: learned kernel against the fixed one, same setting: flexformer_n 242.0 worse than performer (")
    assert "fn_decay 222.3 better than performer (" in decay  # no performer_decay in the study: plain Performer
    with_decay = rows + runs("performer_decay", "performer", (224, 218, 221))
    decay = [line for line in learned_against_its_fixed_kernel(aggregate(with_decay), with_decay) if "fn_decay" in line][0]
    assert "not separated from performer_decay (" in decay and "performer (" not in decay.replace("performer_decay (", "")
    assert learned_against_its_fixed_kernel(aggregate(rows[3:]), rows[3:]) == []  # no Performer: nothing to compare
