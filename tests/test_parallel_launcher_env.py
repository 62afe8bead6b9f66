"""Rank variables from the launcher (megaflex.parallel.launcher_env): ``srun python -m megaflex.train``
and ``mpirun`` without RANK train as one world, and a world of 1 that is really N processes is refused."""

from __future__ import annotations

import subprocess

import pytest

from megaflex.parallel.launcher_env import LaunchEnvError, apply_launcher_env, launcher_env, triton_cache_dir
from megaflex.training.metrics import read_metrics
from training_harness import PYTHON, REPO, base_env, write_config

SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16",
              "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1",
              "SLURM_PROCID": "11", "SLURM_LOCALID": "3"}  # fmt: skip


def test_srun_step_gives_rank_world_and_master():
    env = launcher_env(SLURM_STEP)
    assert env["RANK"] == "11" and env["WORLD_SIZE"] == "16"
    assert env["LOCAL_RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["MASTER_ADDR"] == "gpu07"
    other_rank = launcher_env({**SLURM_STEP, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"})
    assert other_rank["MASTER_PORT"] == env["MASTER_PORT"]  # every rank meets at one port
    assert launcher_env({**SLURM_STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}).keys() == {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}  # fmt: skip


def test_uneven_tasks_per_node():
    env = launcher_env({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "11", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
                        "SLURM_NODEID": "2", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"})  # fmt: skip
    assert env["LOCAL_WORLD_SIZE"] == "3" and env["WORLD_SIZE"] == "11"


def test_open_mpi_needs_a_master_address():
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}  # fmt: skip
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR is not set"):
        launcher_env(ompi)
    env = launcher_env({**ompi, "MASTER_ADDR": "node0"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "4", "0", "1")


def test_no_launcher_a_batch_script_or_one_task_is_a_single_process():
    assert launcher_env({}) == {}
    batch_script = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-4]"}
    assert launcher_env(batch_script) == {}  # no srun step: one process, whatever the allocation
    assert launcher_env({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) == {}


def test_a_world_of_one_that_is_many_processes_is_refused():
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE=1 but the launcher started 16 processes"):
        launcher_env({**SLURM_STEP, "RANK": "0", "WORLD_SIZE": "1"})
    # deepspeed's ranks under one srun task per node: their own (larger) world stands
    assert launcher_env({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "2", "RANK": "5", "WORLD_SIZE": "16"}) == {}


def test_triton_cache_is_per_local_rank_unless_set(tmp_path):
    env = {"TMPDIR": str(tmp_path), "USER": "u", **SLURM_STEP}
    apply_launcher_env(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "megaflex-triton-u" / "local-rank-3")
    assert triton_cache_dir({**env, "LOCAL_RANK": "0"}) != env["TRITON_CACHE_DIR"]
    mine = {"TRITON_CACHE_DIR": "/scratch/triton"}
    apply_launcher_env(mine)
    assert mine["TRITON_CACHE_DIR"] == "/scratch/triton"


def _ranks(tmp_path, per_rank_env: list[dict[str, str]], overrides: list[str]) -> list[subprocess.CompletedProcess]:
    """``python -m megaflex.train`` once per entry, as srun/mpirun would start them (no RANK)."""
    cfg = write_config(tmp_path / "cfg.yaml")
    procs = []
    for extra in per_rank_env:
        env = {k: v for k, v in base_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        env.update(extra, TMPDIR=str(tmp_path))
        procs.append(subprocess.Popen([PYTHON, "-m", "megaflex.train", "--config", str(cfg), *overrides], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_two_processes_without_rank_train_as_one_world(tmp_path, launcher):
    from megaflex.parallel.rendezvous import free_port

    port = str(free_port())
    if launcher == "srun":
        common = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
                  "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0",
                  "MASTER_PORT": port}  # fmt: skip
        envs = [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    else:
        common = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": port}  # fmt: skip
        envs = [{**common, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)} for r in range(2)]
    run = tmp_path / "run"
    results = _ranks(tmp_path, envs, [f"logging.run_dir={run}", "train.train_iters=2", "schedule.warmup_iters=0",
                                      "checkpoint.save_interval=0", "checkpoint.save_at_end=false"])  # fmt: skip
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    assert "world 2 = TP 1 x CP 1 x PP 1 x DP 2" in results[0].stdout
    assert sorted(read_metrics(run / "metrics.jsonl")) == [1, 2]


def test_rank_zero_of_one_under_a_multi_task_step_exits_2(tmp_path):
    env = {"SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0",
           "RANK": "0", "WORLD_SIZE": "1"}  # fmt: skip
    cfg = write_config(tmp_path / "cfg.yaml")
    proc = subprocess.run([PYTHON, "-m", "megaflex.train", "--config", str(cfg), f"logging.run_dir={tmp_path}/run"],
                          cwd=REPO, env={**base_env(), **env}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "launch error: WORLD_SIZE=1 but the launcher started 4 processes (Slurm (srun))" in proc.stderr
    assert not (tmp_path / "run").exists()
