"""``train.compile``: a compiled run trains as the eager one (losses within rounding), its checkpoints
carry the eager parameter names, resume works from a compiled run into an eager one and back, and the
settings it cannot run with are refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaflex.training.config import ConfigError, load_config, validate_runtime
from megaflex.training.metrics import read_metrics
from megaflex.training.train import main as train_main
from training_harness import assert_train_losses_close, launch, write_config

STEPS = ["train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last=2", "train.eval_iters=0",
         "logging.kernel_stats_interval=0"]


def _losses(run_dir: Path, first: int = 1) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items() if s >= first}


@pytest.fixture
def compiler_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py switches TorchDynamo off for the suite (an import it spares every process): on here."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setenv("TORCH_LOGS", "graph_breaks")  # a compiled block says where it breaks for the core


def _train(cfg: Path, run_dir: Path, *overrides: str) -> str:
    # fresh interpreters: the environment of the fork server's ranks (TORCH_LOGS is read when torch is imported)
    # is that of whichever test started it
    result = launch(cfg, [*STEPS, f"logging.run_dir={run_dir}", *overrides], 1, timeout=1800, fresh=True)
    assert result.returncodes == [0], result.output
    return result.output


def _module_keys(run_dir: Path) -> list[str]:
    states = torch.load(run_dir / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    return list(states["module"])


@pytest.mark.slow
def test_compiled_run_trains_as_eager_and_resumes_across(tmp_path: Path, compiler_on: None) -> None:
    """4 steps eager and compiled (saves at 2 and 4), then steps 3-4 again from each run's step-2
    checkpoint with the other setting: every loss within a step's rounding of the eager run's."""
    cfg = write_config(tmp_path / "cfg.yaml")
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert "call_attention_core" not in _train(cfg, eager)
    assert "call_attention_core" in _train(cfg, compiled, "train.compile=true")  # it compiled, around the core
    assert_train_losses_close(_losses(compiled), _losses(eager), ranks=1, name="compiled vs eager")
    keys = _module_keys(compiled)
    assert keys == _module_keys(eager) and not any("_orig_mod" in k for k in keys)

    for source, compile_setting in ((compiled, "false"), (eager, "true")):
        resumed = tmp_path / f"from_{source.name}"
        output = _train(cfg, resumed, f"train.compile={compile_setting}",
                        f"checkpoint.resume={source / 'checkpoints' / 'step_00000002'}")
        assert ("call_attention_core" in output) == (compile_setting == "true")
        assert sorted(_losses(resumed)) == [3, 4]  # it continued from step 2
        assert_train_losses_close(_losses(resumed), _losses(eager, first=3), ranks=1,
                                  name=f"resumed from {source.name} with train.compile={compile_setting}")


@pytest.mark.slow
def test_compiled_runs_under_tensor_sequence_parallelism_zero3_and_checkpointing(tmp_path: Path, compiler_on: None) -> None:
    """The layouts compile runs with (the pipeline engine is refused): TP 2 with sequence parallelism, and
    ZeRO 3 with activation checkpointing (its hooks break the graphs further), each as the eager run."""
    cfg = write_config(tmp_path / "cfg.yaml")
    eager = tmp_path / "eager"
    _train(cfg, eager, "checkpoint.save_interval=0")
    layouts = {"tp2_sp": (2, ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"]),
               "zero3_ac": (1, ["parallel.zero_stage=3", "model.activation_checkpointing=true"])}
    for name, (world, overrides) in layouts.items():
        run_dir = tmp_path / name
        result = launch(cfg, [*STEPS, "checkpoint.save_interval=0", f"logging.run_dir={run_dir}", "train.compile=true",
                              *overrides], world, timeout=1800, fresh=True)
        assert result.returncodes == [0] * world, result.output
        assert_train_losses_close(_losses(run_dir), _losses(eager), ranks=world, name=f"{name} compiled vs eager")


def test_compile_with_pipeline_parallelism_is_one_config_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    overrides = ["train.compile=true", "parallel.pipeline_parallel_size=2", "parallel.zero_stage=1"]
    with pytest.raises(ConfigError, match=r"^train.compile \(from command line\): not supported with "
                                          r"parallel.pipeline_parallel_size > 1"):
        load_config([str(cfg)], overrides)
    assert train_main(["--config", str(cfg), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megaflex-train: config error: train.compile (from command line)")
    assert load_config([str(cfg)], ["train.compile=true"]).train.compile  # alone: fine


@pytest.mark.parametrize("switch", ["TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE"])
def test_compile_where_torch_compile_is_switched_off_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str
) -> None:
    """The blocks would silently stay eager: a config error naming the variable, before anything starts."""
    cfg = load_config([str(write_config(tmp_path / "cfg.yaml"))], ["train.compile=true", "train.device=cpu"])
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setenv(switch, "1")
    with pytest.raises(ConfigError, match=rf"^train.compile \(from command line\): torch.compile is disabled in this "
                                          rf"environment \({switch}=1\)"):
        validate_runtime(cfg, 1, has_cuda=False)
    monkeypatch.setenv(switch, "0")
    validate_runtime(cfg, 1, has_cuda=False)
