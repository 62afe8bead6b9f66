"""What the process launcher says about this rank, in torch.distributed's variables.

torchrun and the deepspeed launcher set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; ``srun python -m
megaflex.train`` and ``mpirun`` do not, and a process that reads only those would be rank 0 of a
world of 1, N times over, all writing one run directory. ``launcher_env`` derives them from Slurm
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, inside an srun step) or Open MPI
(``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``) and refuses a world of 1 that the launcher
says is N processes. ``apply_launcher_env`` puts the result into ``os.environ`` before
torch.distributed starts, with a per-rank node-local ``TRITON_CACHE_DIR`` (ranks compiling into one
shared home directory race and crawl on network file systems).

``local_cuda_device`` picks this rank's CUDA device from LOCAL_RANK and the devices it can see: an
srun step that binds one GPU per task (``--gpus-per-task=1``) shows each rank a single device 0,
whatever its SLURM_LOCALID. ``cuda_unusable_reason`` names why CUDA cannot be used (for the launch
scripts' error messages).
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path

TORCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchEnvError(ValueError):
    """The launcher's variables contradict each other or cannot start a multi-process world."""


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables to add to ``environ`` (empty when the launcher set them, or
    for a plain single process). Raises :class:`LaunchEnvError` on a world that cannot be right."""
    launched = _launcher_world(environ)
    if "RANK" in environ:
        declared = int(environ.get("WORLD_SIZE", "1"))
        if launched is not None and declared < launched[1]:
            raise LaunchEnvError(
                f"WORLD_SIZE={declared} but the launcher started {launched[1]} processes ({launched[0]}): "
                "every process would train alone and write the same run directory; unset RANK/WORLD_SIZE "
                "(they are derived from the launcher) or set them per process"
            )
        return {}
    if launched is None or launched[1] == 1:
        return {}  # one process: the trainer's own single-rank defaults
    source, world, rank, local_rank, local_world = launched
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world)}  # fmt: skip
    if "MASTER_ADDR" not in environ:
        master = _slurm_first_host(environ) if source.startswith("Slurm") else None
        if master is None:
            raise LaunchEnvError(
                f"{world} processes started by {source} but MASTER_ADDR is not set: export MASTER_ADDR=<host "
                "of rank 0> (and MASTER_PORT) to every process"
            )
        env["MASTER_ADDR"] = master
    if "MASTER_PORT" not in environ:
        job = environ.get("SLURM_JOB_ID") or environ.get("OMPI_MCA_orte_hnp_uri") or source
        env["MASTER_PORT"] = str(20000 + zlib.crc32(job.encode()) % 10000)  # the same on every rank
    return env


def launch_rank(environ: Mapping[str, str]) -> int:
    """This process's rank as its launcher numbers it (``RANK``, else Slurm's or Open MPI's), 0 for a
    single process: known before torch.distributed starts (e.g. to print a config error once)."""
    try:
        if "RANK" in environ:
            return int(environ["RANK"])
        launched = _launcher_world(environ)
    except ValueError:  # a malformed variable: launcher_env names it later
        return 0
    return 0 if launched is None else launched[2]


def _launcher_world(environ: Mapping[str, str]) -> tuple[str, int, int, int, int] | None:
    """(launcher, world size, rank, local rank, local world size) from Slurm or Open MPI, or None."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        world, rank = int(environ["OMPI_COMM_WORLD_SIZE"]), int(environ["OMPI_COMM_WORLD_RANK"])
        local = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        local_world = int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        return "Open MPI (mpirun)", world, rank, local, local_world
    # SLURM_STEP_ID (old name SLURM_STEPID) is set inside an srun step only: the batch script itself (one process) also
    # sees SLURM_NTASKS, which counts the allocation's tasks, not processes running.
    if ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ) and "SLURM_PROCID" in environ:
        world = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
        local_world = _tasks_on_this_node(environ)
        return "Slurm (srun)", world, int(environ["SLURM_PROCID"]), int(environ.get("SLURM_LOCALID", "0")), local_world
    return None


def _tasks_on_this_node(environ: Mapping[str, str]) -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ("4(x2),3": 4, 4, 3 by node index)."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return 1
        counts += [int(m[1])] * int(m[2] or 1)
    node = int(environ.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def _slurm_first_host(environ: Mapping[str, str]) -> str | None:
    """The first host of a Slurm node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return None
    if m[2] is None:
        return m[1]
    return m[1] + re.split(r"[-,]", m[2])[0]


def triton_cache_dir(environ: Mapping[str, str]) -> str:
    """A node-local Triton cache per local rank (under TMPDIR), per user."""
    base = Path(environ.get("TMPDIR") or tempfile.gettempdir())
    user = environ.get("USER") or str(os.getuid())
    return str(base / f"megaflex-triton-{user}" / f"local-rank-{environ.get('LOCAL_RANK', '0')}")


def apply_launcher_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Add the derived rank variables and (unless set) ``TRITON_CACHE_DIR`` to ``environ``
    (default ``os.environ``); returns what was added. Call before torch.distributed starts."""
    environ = os.environ if environ is None else environ
    added = launcher_env(environ)
    environ.update(added)
    if "TRITON_CACHE_DIR" not in environ:
        added["TRITON_CACHE_DIR"] = environ["TRITON_CACHE_DIR"] = triton_cache_dir(environ)
    return added


def local_cuda_device(local_rank: int, device_count: int, environ: Mapping[str, str] | None = None) -> int:
    """The CUDA device index of the rank with ``local_rank`` that sees ``device_count`` devices:
    ``local_rank`` when every GPU of the node is visible (torchrun, deepspeed), 0 when one GPU is
    bound to this process (srun ``--gpus-per-task=1``: LOCAL_RANK counts tasks, not visible GPUs).
    Raises :class:`LaunchEnvError` when neither fits: several GPUs visible but fewer than LOCAL_RANK + 1
    (which of them would be a guess, and a wrong one puts two ranks on one GPU)."""
    if device_count == 1 or local_rank < device_count:
        return 0 if device_count == 1 else local_rank
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    raise LaunchEnvError(
        f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA devices"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
        + ": show every rank all of the node's GPUs, or bind one GPU per rank (srun --gpus-per-task=1)"
    )


def nvidia_device_files() -> list[str]:
    """/dev/nvidia0, /dev/nvidia1, ...: the GPUs the driver exposes on this node."""
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


def cuda_unusable_reason() -> str | None:
    """None when torch can use CUDA, else why not, in words a user can act on."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (install a CUDA build: MEGAFLEX_GPU=1 "
                "MEGAFLEX_TORCH_INDEX=<CUDA wheel index> bash launch/setup_env.sh)")  # fmt: skip
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if torch.cuda.is_available():
        return None
    try:
        torch.cuda.init()  # raises with the driver's own reason
    except Exception as err:  # noqa: BLE001  (its message is the answer)
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot initialise CUDA: {err}"
    if not nvidia_device_files():
        return "no NVIDIA GPU on this node (no /dev/nvidia0)"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU"
