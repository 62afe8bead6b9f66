"""Issue 45: what a run config may not ask for is refused while it is validated, in one line with
exit status 2, before any process group or DeepSpeed engine exists, and printed by rank 0 only:
a non-causal language model, every refusal of the attention dispatch table that the settings alone
decide, and counts no one checked."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from megaflex.attention.dispatch import OPS, REFUSALS, SETTING_FIELDS, Request, refused_setting
from megaflex.training.config import ConfigError, load_config
from training_harness import TINY

# A value of each dispatch setting (``dispatch.SETTING_FIELDS`` besides the form) that a config can
# give, with the overrides that give it: a new setting field fails the first assertion below until
# it is listed here, i.e. until its config check is tested.
SETTING_OVERRIDES = {
    ("conv_size", 3): ["model.qkv_conv_size=3"],
    ("window", 8): ["model.softmax_window=8"],
    ("mixing", "gated"): ["model.window_mixing=gated"],
    ("decays", True): ["model.kernel_decay=learned"],
    ("documents", "restart_batched"): ["data.document_boundaries=reset", "data.eod_token_id=0"],
    ("context_parallel", True): ["parallel.context_parallel_size=2"],
}


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def _refusals_for(settings: dict) -> set[str]:
    """The names of every refusal of the table that some op of a model with ``settings`` meets."""
    return {r.name for r in REFUSALS if any(r.applies(Request(op, **settings)) for op in OPS)}


def test_every_refusal_the_settings_decide_is_a_config_error(tiny: Path) -> None:
    """Every combination of the settings, bidirectional: the config is refused with the message of a
    refusal the dispatch table makes for it (never accepted to fail at the first forward), and every
    refusal that settings alone can reach is reported by some config."""
    assert set(SETTING_FIELDS) == {"form"} | {field for field, _ in SETTING_OVERRIDES}, "list the new setting"
    reachable, reported = set(), set()
    for size in range(1, len(SETTING_OVERRIDES) + 1):
        for chosen in itertools.combinations(SETTING_OVERRIDES, size):
            settings = dict(chosen, form="bidirectional")
            refusal = refused_setting(**settings)
            if refusal is None:
                continue
            reachable.add(refusal.name)
            overrides = ["model.causal=false", *(o for key in chosen for o in SETTING_OVERRIDES[key])]
            with pytest.raises(ConfigError) as err:
                load_config([tiny], overrides)
            named = [r for r in REFUSALS if r.message in str(err.value)]
            assert len(named) == 1 and named[0].name in _refusals_for(settings), (overrides, str(err.value))
            reported.add(named[0].name)
    assert reported == reachable
    assert reachable >= {"bidirectional.convolution", "bidirectional.gated_window", "bidirectional.documents",
                         "bidirectional.context_parallel", "bidirectional.decay"}


@pytest.mark.parametrize("overrides,key", [
    (["model.qkv_conv_size=3"], "model.qkv_conv_size"),
    (["model.softmax_window=8", "model.window_mixing=gated"], "model.window_mixing"),
    (["model.kernel_decay=learned"], "model.kernel_decay"),
    (["data.document_boundaries=reset", "data.eod_token_id=0"], "data.document_boundaries"),
    (["parallel.context_parallel_size=2"], "parallel.context_parallel_size"),
])  # fmt: skip
def test_a_refused_setting_names_its_key_and_source(tiny: Path, overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} \(from command line\): \w+: .*, or build the model causal \(ModelConfig.causal=True"):
        load_config([tiny], ["model.causal=false", *overrides])
    assert load_config([tiny], overrides).model.causal  # the causal model with the same setting is served


def test_the_language_model_trainer_refuses_a_bidirectional_model(tiny: Path) -> None:
    """Issue 45: model.causal=false trained a "language model" that sees the token it predicts, exit 0."""
    with pytest.raises(ConfigError, match=r"^model\.causal \(from command line\): false builds a bidirectional encoder, "
                                          r".*train an encoder with python -m megaflex\.training\.classify$"):
        load_config([tiny], ["model.causal=false"])


@pytest.mark.parametrize("rank_env,printed", [({}, True), ({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                              ({"RANK": "1", "WORLD_SIZE": "2"}, False),
                                              ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, False)])
def test_a_config_error_is_printed_by_rank_0_only(tiny: Path, rank_env: dict, printed: bool,
                                                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Every rank validates the same config: one line in all (rank 0's), exit 2 on every rank."""
    from megaflex.training.distill.cli import main as distill_main
    from megaflex.training.train import main

    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in rank_env.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", str(tiny), "model.causal=false", "model.qkv_conv_size=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == int(printed) and "Traceback" not in err
    if printed:
        assert err.startswith("megaflex-train: config error: model.qkv_conv_size (from command line): qkv_conv_size: ")
    assert distill_main(["--config", str(tiny)]) == 2  # no teacher
    assert ("megaflex-distill: config error: distill.teacher" in capsys.readouterr().err) == printed


@pytest.mark.parametrize("override,message", [
    ("train.global_batch_size=0", "train.global_batch_size (from command line): expected a positive integer, got 0"),
    ("schedule.decay_iters=0", "schedule.decay_iters (from command line): expected a positive integer, got 0"),
    ("train.fp16_loss_scale_window=0", "train.fp16_loss_scale_window (from command line): expected a positive integer"),
    ("train.fp16_hysteresis=-1", "train.fp16_hysteresis (from command line): expected a positive integer, got -1"),
    ("train.fp16_initial_scale_power=-2", "train.fp16_initial_scale_power (from command line): expected >= 0, got -2"),
    ("fault.sigkill_after_step=0", "fault.sigkill_after_step (from command line): expected a positive integer, got 0"),
])  # fmt: skip
def test_counts_no_one_checked_are_refused(tiny: Path, override: str, message: str) -> None:
    """Issue 45: train.global_batch_size=0 was taken as unset (micro x DP), schedule.decay_iters=0
    trained at min_lr from step 1; null keeps its meaning."""
    with pytest.raises(ConfigError) as err:
        load_config([tiny], [override])
    assert str(err.value).startswith(message)
    key = override.split("=")[0]
    load_config([tiny], [f"{key}=null"] if key in ("train.global_batch_size", "schedule.decay_iters") else [])
