"""The real ``deepspeed`` launcher starts 2 local CPU (gloo) ranks that train a few steps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megaflex.parallel.rendezvous import free_port
from megaflex.training.metrics import read_metrics
from training_harness import REPO, base_env, write_config

pytestmark = pytest.mark.slow


def test_deepspeed_launcher_two_cpu_ranks(tmp_path: Path) -> None:
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher script is not installed next to the interpreter"
    cfg = write_config(tmp_path / "cfg.yaml")
    env = base_env()
    env["LOCAL_SIZE"] = "2"  # DeepSpeed's CPU accelerator reports this many local "slots"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")  # nothing prebuilt
    run, port = tmp_path / "run", free_port()
    out = subprocess.run(
        [launcher, "--num_gpus", "2", "--master_port", str(port), "--module", "megaflex.train",
         "--config", str(cfg), f"logging.run_dir={run}", "train.train_iters=4", "checkpoint.save_interval=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "world 2 = TP 1 x CP 1 x PP 1 x DP 2" in out.stdout
    records = read_metrics(run / "metrics.jsonl")
    assert sorted(records) == [1, 2, 3, 4] and all(r["tokens_per_s"] > 0 for r in records.values())
    assert (run / "checkpoints" / "step_00000004" / "megaflex.json").is_file()  # saved at the end
    # DeepSpeed's CPU shm all-reduce op is neither compiled nor mapped: it leaked a /dev/shm
    # buffer per rank per run and hung ranks where /dev/shm is small.
    assert not (tmp_path / "torch_extensions" / "deepspeed_shm_comm").exists()
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_bad_hostfile_is_rejected_with_the_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=4\nnode2 gpus=4\n")
    out = subprocess.run([sys.executable, "launch/check_hostfile.py", str(hostfile)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert f"hostfile {hostfile} line 2: expected '<hostname> slots=<N>', got 'node2 gpus=4'" in out.stderr
    hostfile.write_text("no-such-host.invalid slots=1\n")
    out = subprocess.run([sys.executable, "launch/check_hostfile.py", str(hostfile), "--ssh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not reachable by passwordless ssh: no-such-host.invalid" in out.stderr
