"""Launch and checkpoint faults of the real trainer (multi-process, CPU): an unwritable checkpoint
dir, a corrupt checkpoint, a full disk during a save, SIGTERM to launch/train.sh or to the
deepspeed runner."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megaflex.checkpoint.layout import complete_tags, directory_size, read_latest, verify_checkpoint
from megaflex.training.metrics import read_metrics
from megaflex.training.train import EXIT_CONFIG, EXIT_PREEMPTED
from training_harness import REPO, deepspeed_launcher, launch, launcher_env, write_config

pytestmark = pytest.mark.slow


def _ok(result) -> None:
    assert all(rc == 0 for rc in result.returncodes), result.output


def test_unwritable_checkpoint_dir_fails_before_the_first_step(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", f"checkpoint.dir={blocker / 'ckpt'}"], world_size=1)
    assert result.returncodes == [EXIT_CONFIG], result.output
    assert f"checkpoint directory {blocker / 'ckpt'} is not writable" in result.outputs[0]
    assert not (run / "metrics.jsonl").exists() or not read_metrics(run / "metrics.jsonl")  # no step was lost


def test_corrupt_checkpoint_is_named_and_auto_resume_falls_back(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    common = [f"logging.run_dir={run}", "train.train_iters=12", "checkpoint.save_interval=5", "parallel.zero_stage=1"]
    _ok(launch(cfg, common, world_size=1))
    first = read_metrics(run / "metrics.jsonl")
    ckpt = run / "checkpoints"
    assert complete_tags(ckpt) == ["step_00000005", "step_00000010", "step_00000012"]
    shard = next((ckpt / "step_00000012").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated

    explicit = launch(cfg, common + ["checkpoint.resume=step_00000012"], world_size=1)
    assert explicit.returncodes == [EXIT_CONFIG], explicit.output
    assert f"corrupt checkpoint file {shard}: 1000 bytes, expected" in explicit.outputs[0]

    auto = launch(cfg, common + ["checkpoint.resume=auto"], world_size=1)
    _ok(auto)
    out = auto.outputs[0]
    assert f"skipping checkpoint {ckpt / 'step_00000012'}" in out and "resuming from the OLDER checkpoint" in out
    assert "at step 10" in out
    again = read_metrics(run / "metrics.jsonl")
    assert [again[s]["loss"] for s in (11, 12)] == [first[s]["loss"] for s in (11, 12)]  # bit-exact from step 10


@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path: Path, background: bool) -> None:
    """A real full disk: a tmpfs sized for one and a half checkpoints (needs mount permission). With
    checkpoint.background the writer thread's error fails the run with the same line."""
    cfg = write_config(tmp_path / "cfg.yaml")
    common = ["checkpoint.save_interval=5", "parallel.zero_stage=1", "checkpoint.keep_last=5",
              f"checkpoint.background={str(background).lower()}"]
    probe = tmp_path / "probe"
    _ok(launch(cfg, common + [f"logging.run_dir={probe}", "train.train_iters=5"], world_size=1))
    size = directory_size(probe / "checkpoints" / "step_00000005")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr.strip()}")
    try:
        run = tmp_path / "run"
        result = launch(cfg, common + [f"logging.run_dir={run}", f"checkpoint.dir={small}", "train.train_iters=10"], 1)
        assert result.returncodes == [EXIT_CONFIG], result.output
        out = result.outputs[0]
        assert f"saving the checkpoint of step 10 failed: no space left on {small}" in out
        assert f"the previous checkpoint {small / 'step_00000005'} is kept" in out
        assert not list(small.glob(".tmp-*"))  # the partial save is gone
        assert read_latest(small) == "step_00000005" and verify_checkpoint(small / "step_00000005")["iteration"] == 5
    finally:
        subprocess.run(["umount", str(small)], check=False)


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(read_metrics(metrics)) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {steps} (rc {proc.poll()})")


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _start(cmd: list[str], env: dict[str, str], tmp_path: Path, run: Path) -> subprocess.Popen:
    cfg = write_config(tmp_path / "cfg.yaml")
    args = ["--config", str(cfg), f"logging.run_dir={run}", "train.train_iters=100000", "checkpoint.save_interval=0"]
    log = open(tmp_path / "out.log", "w")
    return subprocess.Popen(cmd + args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: nothing is left behind


@pytest.mark.parametrize("target", ["train.sh", "deepspeed runner", "every process (Slurm step, USR1)"])
def test_sigterm_reaches_the_ranks_which_save_and_exit(tmp_path: Path, target: str) -> None:
    run, env = tmp_path / "run", launcher_env(2)
    if target == "deepspeed runner":
        cmd = [deepspeed_launcher(), "--num_gpus", "2", "--master_port", env["MASTER_PORT"], "--module", "megaflex.train"]
    else:
        cmd = ["bash", "launch/train.sh"]
    sig = signal.SIGUSR1 if "USR1" in target else signal.SIGTERM
    proc = _start(cmd, env, tmp_path, run)
    try:
        _wait_for_steps(run / "metrics.jsonl", proc, 2)
        if "every process" in target:  # Slurm's --signal without B:, or scancel --signal: the runner too
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        rc = proc.wait(timeout=300)
        assert _group_gone(proc.pid, 300), "rank processes outlived the launcher"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = (tmp_path / "out.log").read_text()
    stopped = max(read_metrics(run / "metrics.jsonl"))
    assert f"training stopped (signal {sig.name}) at step {stopped}" in out, out[-4000:]
    assert complete_tags(run / "checkpoints") == [f"step_{stopped:08d}"]
    if target != "deepspeed runner":  # USR1 to every process: the runner (ignoring it) passes the ranks' status on
        assert rc == EXIT_PREEMPTED, out[-4000:]  # the ranks' status, told apart from a finished run's 0
    else:
        # The runner itself dies of the signal (it forwards nothing); its ranks noticed and saved.
        assert "the deepspeed launcher (pid" in out
