"""Rank variables from the launcher (megaflex.parallel.launcher_env): ``srun python -m megaflex.train``
and ``mpirun`` without RANK train as one world, and a world of 1 that is really N processes is refused."""

from __future__ import annotations

import subprocess

import pytest

from megaflex.parallel.launcher_env import (
    LaunchEnvError, apply_launcher_env, launcher_env, local_cuda_device, triton_cache_dir,
)
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


def test_local_cuda_device_follows_the_visible_gpus():
    assert local_cuda_device(3, 8) == 3  # torchrun / deepspeed: every GPU of the node visible
    assert local_cuda_device(3, 1) == 0  # srun --gpus-per-task=1: SLURM_LOCALID 3 sees one GPU, device 0
    assert local_cuda_device(0, 2) == 0 and local_cuda_device(1, 2) == 1
    with pytest.raises(LaunchEnvError, match=r"LOCAL_RANK=5 but this process sees 2 CUDA devices \(CUDA_VISIBLE_DEVICES=6,7\)"):
        local_cuda_device(5, 2, {"CUDA_VISIBLE_DEVICES": "6,7"})


@pytest.mark.parametrize("visible, expected", [(1, 0), (8, 3), (2, None)])
def test_the_trainer_sets_the_device_from_local_rank_and_the_visible_count(tmp_path, monkeypatch, visible, expected):
    """``srun python -m megaflex.train`` with one GPU per task: LOCAL_RANK=3 (from SLURM_LOCALID) on a
    process that sees one device must not ask for device 3 ("invalid device ordinal")."""
    import torch

    from megaflex.training import trainer
    from megaflex.training.config import load_config

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(trainer, "init_deepspeed_distributed", lambda backend, timeout: chosen.append(backend))
    monkeypatch.setattr(trainer, "validate_runtime", lambda *args: None)
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda: 16)
    for key, value in {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "MASTER_ADDR": "gpu07"}.items():
        monkeypatch.setenv(key, value)
    cfg = load_config([str(write_config(tmp_path / "cfg.yaml"))], ["train.device=cuda"])
    if expected is None:
        with pytest.raises(LaunchEnvError, match="LOCAL_RANK=3 but this process sees 2 CUDA devices"):
            trainer.init_distributed(cfg)
        assert chosen == []  # refused before any device or process group
    else:
        assert trainer.init_distributed(cfg) == "cuda"
        assert chosen == [expected, "nccl"]


def test_a_launch_error_in_the_trainer_is_one_line_and_exit_2(monkeypatch, capsys):
    from megaflex.training import train, trainer

    def refuse(cfg, objective=None):
        raise LaunchEnvError("LOCAL_RANK=3 but this process sees 2 CUDA devices")

    monkeypatch.setattr(trainer, "run", refuse)
    monkeypatch.setattr(trainer, "shutdown", lambda clean: None)
    from types import SimpleNamespace

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save_on_signal=False))  # no start-up signal watcher
    assert train.execute("megaflex-train", cfg) == 2
    assert capsys.readouterr().err == "megaflex-train: launch error: LOCAL_RANK=3 but this process sees 2 CUDA devices\n"
