"""Two "nodes" on one machine: two real deepspeed launchers (``--no_ssh --node_rank 0/1``, one
CPU rank each, master 127.0.0.1) train ZeRO-1, checkpoint, resume bit-exact, and equal the
one-node two-rank run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megaflex.checkpoint.layout import complete_tags
from megaflex.training.metrics import read_metrics
from training_harness import REPO, deepspeed_launcher, launch, launcher_env, write_config

pytestmark = pytest.mark.slow


def two_node_run(cfg: Path, overrides: list[str], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """One deepspeed launcher per "node", both on this machine; waits for both."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")  # names only: --no_ssh never contacts them
    env = launcher_env(1)
    procs = []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}-{env['MASTER_PORT']}.log", "w+")
        cmd = [deepspeed_launcher(), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
               "--master_addr", "127.0.0.1", "--master_port", env["MASTER_PORT"], "--module", "megaflex.train",
               "--config", str(cfg), *overrides]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    for proc, log in procs:
        proc.wait(timeout=900)
        log.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, log.read()))
        log.close()
    return results


def test_two_nodes_train_checkpoint_resume_and_equal_one_node(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    common = ["parallel.zero_stage=1", "train.train_iters=5", "checkpoint.save_interval=2", "train.eval_iters=1"]
    no_end_save = ["checkpoint.save_at_end=false"]  # no one resumes the runs that finish
    one_node = launch(cfg, common + no_end_save + ["checkpoint.save_interval=0", f"logging.run_dir={tmp_path / 'one'}"],
                      world_size=2)
    assert one_node.returncodes == [0, 0], one_node.output

    run = tmp_path / "two"
    killed = two_node_run(cfg, common + [f"logging.run_dir={run}", "fault.sigkill_after_step=4"], tmp_path)
    assert all(r.returncode != 0 for r in killed), [r.stdout[-3000:] for r in killed]
    assert "world 2 = TP 1 x CP 1 x PP 1 x DP 2" in killed[0].stdout  # one rank per launcher, one world
    assert "--node_rank=1" in killed[1].stdout  # node 1's launcher started global rank 1
    assert complete_tags(run / "checkpoints") == ["step_00000002", "step_00000004"]

    resumed = two_node_run(cfg, common + no_end_save + [f"logging.run_dir={run}", "checkpoint.resume=auto"], tmp_path)
    assert all(r.returncode == 0 for r in resumed), [r.stdout[-3000:] for r in resumed]
    assert "at step 4" in resumed[0].stdout

    want, got = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [got[s]["loss"] for s in range(1, 6)] == [want[s]["loss"] for s in range(1, 6)]  # bit for bit
    assert len({want[s]["loss"] for s in range(1, 6)}) > 1
