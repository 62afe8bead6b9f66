"""The trainer's optional logging components: torch.profiler traces and Weights & Biases (offline).

Each test launches the real ``python -m megaflex.train`` on the tiny config of ``training_harness``.
W&B never touches the network here: ``mode: offline``, WANDB_MODE=offline, files under tmp_path,
read back from the run's .wandb file (``wandb_offline``).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from megaflex.training.metrics import read_metrics
from megaflex.training.profiling import read_ops
from training_harness import PYTHON, REPO, TINY, base_env, launch, write_config
from wandb_offline import CHUNK, FULL, HEADER, finished, history, records, run_config, run_files, run_id


def _tiny(tmp_path: Path, train_iters: int) -> Path:
    data = copy.deepcopy(TINY)
    data["train"]["train_iters"] = train_iters
    data["checkpoint"] = {"save_interval": 0, "keep_last": 2}
    return write_config(tmp_path / "cfg.yaml", data)


@pytest.mark.slow
def test_profile_writes_a_trace_naming_the_attention_ops(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch(_tiny(tmp_path, 4), [f"logging.run_dir={run_dir}", "logging.profile.start=2", "logging.profile.steps=2"])
    assert result.returncodes == [0], result.output
    trace = run_dir / "profile" / "rank0.steps2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace format
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    # one range per attention layer and micro-batch of the two profiled steps, none outside them
    calls = TINY["model"]["num_layers"] * (TINY["train"]["global_batch_size"] // TINY["train"]["micro_batch_size"]) * 2
    assert names.count("megaflex.attention") == calls
    assert names.count("megaflex.attention.flexformer_n") == calls
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any("Backward" in n and "Linear" in n for n in names), sorted(set(names))[:50]  # the attention's backward
    ops = read_ops(run_dir / "profile" / "rank0.steps2-3.ops.json")  # the same window, per op, for scripts
    by_name = {op["name"]: op for op in ops["ops"]}
    assert ops["steps"] == 2 and by_name["megaflex.attention.flexformer_n"]["count"] == calls
    assert by_name["aten::mm"]["self_cpu_us"] > 0
    log = result.outputs[0]
    table = log[log.index("profile of steps 2-3 (rank 0, top 12 ops by self_cpu_time_total)"):]
    assert "Self CPU" in table and str(trace) in table


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("wandb")  # the dev extra installs it; CI has it
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(wandb_dir),
                       "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(key, value)  # launch() passes the environment on
    return wandb_dir


@pytest.mark.slow
def test_wandb_offline_logs_the_scalars_and_a_resume_continues_the_run(tmp_path: Path, wandb_env: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = _tiny(tmp_path, 4)
    common = [f"logging.run_dir={run_dir}", "logging.wandb.mode=offline", "logging.wandb.project=megaflex-test",
              "logging.wandb.tags=[tiny,ci]", "logging.kernel_stats_interval=2", "logging.tensorboard=true"]
    first = launch(cfg, common)
    assert first.returncodes == [0], first.output
    resumed = launch(cfg, common + ["train.train_iters=6"])  # continues from the step-4 checkpoint
    assert resumed.returncodes == [0] and "at step 4" in resumed.outputs[0], resumed.output

    files = [finished(f) for f in run_files(wandb_env)]
    assert len(files) == 2  # one offline folder per process, both of one W&B run
    saved_id = (run_dir / "wandb_run_id").read_text().strip()
    assert run_id(files[0]) == run_id(files[1]) == saved_id
    logged = {**history(files[0]), **history(files[1])}
    assert sorted(s for s in logged if s) == [1, 2, 3, 4, 5, 6]
    train, valid, kernel = (read_metrics(run_dir / "metrics.jsonl", kind) for kind in ("train", "valid", "kernel"))
    for step, record in train.items():  # the same values as metrics.jsonl / TensorBoard, bit for bit
        for key in ("loss", "ppl", "lr", "grad_norm", "tokens_per_s", "memory_mb", "tflops_per_device"):
            assert logged[step][f"train/{key}"] == record[key], (step, key)
    assert {s for s in valid} == {4, 6} and all(logged[s]["valid/loss"] == valid[s]["loss"] for s in valid)
    assert sorted(kernel) == [2, 4, 6]
    for step, record in kernel.items():
        scalars = {k: v for k, v in record.items() if k not in ("kind", "step")}
        assert scalars and all(logged[step][f"kernel/{k}"] == v for k, v in scalars.items())
    assert _tensorboard_scalars(run_dir / "tensorboard") == _as_float32({
        (step, key): value for step, row in logged.items() for key, value in row.items() if not key.startswith("_")
    })  # W&B got exactly TensorBoard's scalars (TensorBoard stores them as float32)
    config = run_config(files[1])
    assert config["train"]["train_iters"] == 6 and config["logging"]["wandb"]["tags"] == ["tiny", "ci"]
    assert config["model"] == run_config(files[0])["model"]


def _tensorboard_scalars(directory: Path) -> dict[tuple[int, str], float]:
    """(step, tag) -> value of every scalar in the TensorBoard event files of ``directory``, as float64."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(directory.glob("events.out.tfevents.*")):  # one file per process, in time order
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.update({(e.step, tag): e.value for e in acc.Scalars(tag)})
    return scalars


def _as_float32(values: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    return {k: float(np.float32(v)) for k, v in values.items()}


def test_missing_wandb_is_a_one_line_config_error(tmp_path: Path) -> None:
    code = "import sys; sys.modules['wandb'] = None; from megaflex.training.train import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [PYTHON, "-c", code, "--config", str(_tiny(tmp_path, 4)), f"logging.run_dir={tmp_path / 'run'}",
         "logging.wandb.project=x"],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300,
    )
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "config error: logging.wandb: the wandb package is not installed; pip install 'megaflex[wandb]'" in errors[0]


@pytest.mark.parametrize("overrides,needle", [
    (["logging.profile.start=0"], "logging.profile.start (from command line): expected a positive integer, got 0"),
    (["logging.profile.steps=0"], "logging.profile.steps (from command line): expected a positive integer, got 0"),
    (["logging.profile.start=5"], "logging.profile.start (from command line): expected <= train.train_iters (4), got 5"),
    (["logging.wandb.mode=cloud"], "'logging.wandb.mode' (from command line): expected one of 'online', 'offline', 'disabled'"),
    (["logging.wandb.colour=red"], "unknown config key 'logging.wandb.colour'"),
])
def test_logging_component_config_errors(tmp_path: Path, overrides: list[str], needle: str) -> None:
    from megaflex.training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config([_tiny(tmp_path, 4)], overrides)
    assert needle in str(err.value)


def test_wandb_run_id_is_reused_by_a_resume_only(tmp_path: Path, wandb_env: Path) -> None:
    from megaflex.training.config import WandbConfig
    from megaflex.training.wandb_logger import RUN_ID_FILE, WandbSink

    run_dir, settings = tmp_path / "run", WandbConfig(project="megaflex-test", mode="offline")
    run_dir.mkdir()
    ids = []
    for resuming in (False, True, False):  # a fresh start, its resume, a fresh start in the same folder
        sink = WandbSink.open(settings, run_dir, {"train": {"lr": 1.0}}, resuming=resuming)
        sink.write({"train/loss": 1.5}, step=len(ids) + 1)
        ids.append(sink.run.id)
        sink.close()
        assert (run_dir / RUN_ID_FILE).read_text().strip() == ids[-1]
    assert ids[0] == ids[1] != ids[2]
    # W&B flushes a file after finish() returns: wait for it (it failed under load reading too early)
    assert sorted(run_id(finished(f)) for f in run_files(wandb_env)) == sorted(ids)  # folder names may share a second


def test_the_wandb_reader_waits_for_a_file_still_being_written(tmp_path: Path) -> None:
    """Issue 45 class 9: right after finish() a .wandb file may hold its header only, or end in a
    partly written chunk; the reader reads what is complete and ``finished`` waits for the exit record."""
    pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    run, exit_ = pb2.Record(), pb2.Record()
    run.run.run_id = "abc123"
    exit_.exit.exit_code = 0
    chunks = b"".join(CHUNK.pack(0, len(r.SerializeToString()), FULL) + r.SerializeToString() for r in (run, exit_))
    path, whole = tmp_path / "run-abc123.wandb", HEADER.pack(b":W&B", 0xBEE1, 0) + chunks
    path.write_bytes(whole[:-3])  # the exit record cut short
    assert [r.WhichOneof("record_type") for r in records(path)] == ["run"]
    writer = threading.Timer(0.5, path.write_bytes, [whole])
    writer.start()
    try:
        assert run_id(finished(path, timeout=60)) == "abc123"
    finally:
        writer.join()
    path.write_bytes(whole[:HEADER.size])
    with pytest.raises(AssertionError, match="no exit record"):
        finished(path, timeout=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("tensorboard", [False, True])
def test_last_line_names_the_tensorboard_folder_only_when_it_is_written(tmp_path: Path, tensorboard: bool) -> None:
    run_dir = tmp_path / "run"
    result = launch(_tiny(tmp_path, 4), [f"logging.run_dir={run_dir}", f"logging.tensorboard={str(tensorboard).lower()}",
                                         "logging.kernel_stats_interval=0"])
    assert result.returncodes == [0], result.output
    last = [line for line in result.outputs[0].splitlines() if line.strip()][-1]
    assert last.startswith("training stopped (done) at step 4; metrics ") and "checkpoints " in last, last
    assert ("TensorBoard" in last) == tensorboard == (run_dir / "tensorboard").is_dir(), last


def test_missing_tensorboard_warns_and_logs_metrics_jsonl_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU node's offline install has no tensorboard (an extra): ``logging.tensorboard`` (on by
    default) then warns once and the run keeps every scalar in metrics.jsonl."""
    from megaflex.training.metrics import TENSORBOARD_MISSING, MetricsLogger

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an uninstalled package looks like to find_spec
    with pytest.warns(UserWarning, match="logging.tensorboard: the tensorboard package is not installed") as record:
        logger = MetricsLogger(tmp_path, enabled=True, tensorboard=True, progress_bar=False, total_steps=2)
    assert [str(w.message) for w in record] == [TENSORBOARD_MISSING]
    logger.log({"kind": "train", "step": 1, "loss": 2.5, "ppl": 12.2, "lr": 1e-3, "tokens_per_s": 10.0}, {"train/loss": 2.5})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["loss"] == 2.5
    assert not (tmp_path / "tensorboard").exists()
