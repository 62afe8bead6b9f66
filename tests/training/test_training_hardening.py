"""One live run per run directory, resume layout checks from the metadata, the collective
timeout, and prompt saves on a signal during validation (real processes, tiny model, CPU)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from failure_helpers import one_error_line
from megaflex.checkpoint.layout import CheckpointError
from megaflex.checkpoint import CheckpointMeta, check_resume_layout
from training_harness import PYTHON, REPO, TINY, base_env, launch, write_config

SHORT = copy.deepcopy(TINY)
SHORT["train"].update(train_iters=2, eval_iters=1)  # the end-of-run validation: one batch
SHORT["schedule"].update(warmup_iters=0)
SHORT["checkpoint"].update(save_interval=0)
SHORT["logging"].update(kernel_stats_interval=0)


def _start(cfg: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    env = base_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen([PYTHON, "-m", "megaflex.train", "--config", str(cfg), *overrides], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_second_run_on_a_live_run_dir_exits_2_and_a_stale_lock_is_taken_over(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    live_log = tmp_path / "live.log"
    live = _start(cfg, [f"logging.run_dir={run}", "train.train_iters=100000"], live_log)
    try:
        _wait_for(lambda: "step 1/" in live_log.read_text(), 180, "the first run's first step")
        lock = json.loads((run / "run.lock").read_text())
        assert lock["pid"] == live.pid and lock["host"] == socket.gethostname()
        config_before = (run / "config.yaml").read_text()
        second = launch(cfg, [f"logging.run_dir={run}", "train.lr=1e-3"])
        assert second.returncodes == [2], second.output
        err = one_error_line(second.outputs[0], "megaflex-train")
        assert f"logging.run_dir {run} is in use by a live run: pid {live.pid} on host {socket.gethostname()}" in err
        assert (run / "config.yaml").read_text() == config_before  # the refused run wrote nothing
        live.send_signal(signal.SIGTERM)
        assert live.wait(timeout=120) == 75
    finally:
        if live.poll() is None:
            live.kill()
    assert not (run / "run.lock").exists()  # released at exit
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    third = launch(cfg, [f"logging.run_dir={run}"])
    assert third.returncodes == [0], third.output
    assert f"taking over the stale lock {run / 'run.lock'} of pid {dead.pid}" in third.outputs[0]
    assert not (run / "run.lock").exists()


@pytest.mark.parametrize("errno_, reason", [(30, "Read-only file system"), (13, "Permission denied")])
def test_an_unwritable_run_dir_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int,
                                                 reason: str) -> None:
    """A read-only mount or a folder without write permission (simulated: chmod does not stop root,
    so os.open fails as such a mount makes it fail) is one ConfigError naming the run dir, not a
    traceback. tests/training/test_failure_modes.py runs the real trainer on a path under a regular file."""
    from megaflex.training import run_lock
    from megaflex.training.config import ConfigError

    def refuse(path, *args, **kwargs):
        raise OSError(errno_, os.strerror(errno_), str(path))

    monkeypatch.setattr(run_lock.os, "open", refuse)
    with pytest.raises(ConfigError, match=f"logging.run_dir {tmp_path} is not writable: {reason}; set logging.run_dir"):
        run_lock.acquire(tmp_path, print)
    assert not (tmp_path / "run.lock").exists()


def test_weights_only_checkpoint_is_not_resumed() -> None:
    meta = {"zero_stage": 0, "source": "megaflex-export --from-hf hf/x"}
    with pytest.raises(CheckpointError, match=r"holds weights only \(written by megaflex-export --from-hf hf/x\).*"
                                              r"checkpoint.init_from=ck/step_1 checkpoint.resume=none"):
        check_resume_layout(CheckpointMeta.from_dict(meta), Path("ck/step_1"), zero_stage=0, precision="fp32")
    saved = CheckpointMeta.from_dict({"zero_stage": 1, "precision": "fp32", "deepspeed_config": {}})
    check_resume_layout(saved, Path("ck"), zero_stage=2, precision="fp32")  # ZeRO 1 <-> 2 load
    with pytest.raises(CheckpointError, match=r"saved with train.precision=fp32, this run has bf16.*Resume with "
                                              r"train.precision=fp32, or start a new run from its weights"):
        check_resume_layout(saved, Path("ck"), zero_stage=1, precision="bf16")


@pytest.mark.slow
def test_changing_the_zero_stage_on_resume_exits_2_naming_both_stages(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    # 1 -> 3 is the "resuming with another ZeRO stage" case of tests/training/test_failure_modes.py
    for saved, changes in ((1, (0,)), (0, (1,)), (3, (1,))):
        run = tmp_path / f"z{saved}"
        first = launch(cfg, [f"logging.run_dir={run}", f"parallel.zero_stage={saved}"])
        assert first.returncodes == [0], first.output
        for zero in changes:
            resumed = launch(cfg, [f"logging.run_dir={run}", f"parallel.zero_stage={zero}", "train.train_iters=3"])
            assert resumed.returncodes == [2], resumed.output
            err = one_error_line(resumed.outputs[0], "megaflex-train")
            assert (f"checkpoint error: checkpoint {run / 'checkpoints' / 'step_00000002'} was saved with ZeRO stage "
                    f"{saved}, this run has parallel.zero_stage={zero}") in err
            assert f"Resume with parallel.zero_stage={saved}, or start a new run from its weights" in err


@pytest.mark.slow
def test_a_frozen_peer_makes_the_others_exit_naming_step_and_collective(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    start = time.time()
    result = launch(cfg, [f"logging.run_dir={tmp_path / 'run'}", "train.train_iters=50", "parallel.zero_stage=1",
                          "parallel.timeout_minutes=0.05", "fault.sigstop_last_rank_after_step=2"], world_size=2,
                    timeout=300, grace=1)  # the stopped rank never exits: kill it once rank 0 has
    assert time.time() - start < 200  # not torch's 30 minutes
    assert result.returncodes[0] == 1, result.output
    err = one_error_line(result.outputs[0], "megaflex-train")
    assert "rank 0: collective timed out at step 3 in forward/backward (ZeRO gradient reduction)" in err and "after 0.05 min" in err, err


@pytest.mark.slow
def test_sigterm_during_a_long_validation_saves_promptly(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run, log = tmp_path / "run", tmp_path / "train.log"
    # 10^6 validation batches (an hour here): only a check between batches can stop it in time
    proc = _start(cfg, [f"logging.run_dir={run}", "train.train_iters=10", "train.eval_interval=2",
                        "train.eval_iters=1000000"], log)
    try:
        _wait_for(lambda: "step 2/10" in log.read_text(), 180, "step 2")
        time.sleep(1.0)  # inside the validation pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "validation at step 2 stopped by a signal" in text
    assert (run / "checkpoints" / "step_00000002" / "megaflex.json").is_file()
    assert not any(json.loads(line).get("kind") == "valid" for line in (run / "metrics.jsonl").read_text().splitlines())
    assert os.path.getsize(run / "metrics.jsonl") > 0


@pytest.mark.slow
def test_sigterm_during_a_save_stops_after_it_without_another_step(tmp_path: Path) -> None:
    """The signal lands in the save of step 2 (fault injection, before the commit): the run stops
    with that checkpoint (before: it ran step 3 and saved again)."""
    from training_harness import logged_train_steps

    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", "train.train_iters=6", "checkpoint.save_interval=2",
                          "fault.sigterm_during_save_at_step=2"])
    assert result.returncodes == [75], result.output
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert logged_train_steps(run) == [1, 2]
    assert result.outputs[0].count("saved checkpoint") == 1
    assert "training stopped (signal SIGTERM) at step 2" in result.outputs[0]


@pytest.mark.slow
def test_sigterm_during_a_background_save_waits_for_the_write_then_exits_75(tmp_path: Path) -> None:
    """checkpoint.background: the signal comes from the writer thread of step 2's save, after its first
    file, while training may go on; the run stops at the step where the ranks agree on it, waits for the
    write in flight, commits it, saves the stop step, and exits 75."""
    from megaflex.checkpoint.layout import complete_tags, verify_checkpoint
    from training_harness import logged_train_steps

    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", "train.train_iters=50", "checkpoint.save_interval=2",
                          "checkpoint.background=true", "fault.sigterm_during_save_at_step=2"], world_size=2)
    assert result.returncodes == [75, 75], result.output
    stopped = max(logged_train_steps(run))
    assert f"training stopped (signal SIGTERM) at step {stopped}" in result.outputs[0]
    ckpt = run / "checkpoints"
    tags = complete_tags(ckpt)
    assert tags[0] == "step_00000002" and tags[-1] == f"step_{stopped:08d}"  # the write in flight, then the stop step
    assert all(verify_checkpoint(ckpt / tag)["iteration"] == int(tag[5:]) for tag in tags)
    assert not list(ckpt.glob(".tmp-*"))


@pytest.mark.slow
def test_sigterm_during_startup_exits_143_with_one_line(tmp_path: Path) -> None:
    """Before the first step there is nothing to save: the process ends at once, as SIGTERM's
    default action would (143), but says so (before: no output at all)."""
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", "fault.sigterm_during_startup=true"])
    assert result.returncodes == [143], result.output
    assert "Traceback" not in result.outputs[0]
    lines = [line for line in result.outputs[0].splitlines() if "during start-up" in line]
    assert lines == ["megaflex-train: stopped by SIGTERM during start-up, before any step (nothing to save); exit 143"]
    assert not (run / "run.lock").exists() and not (run / "checkpoints").exists()
