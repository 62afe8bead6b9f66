"""Process-group bookkeeping for tensor (and, later, pipeline) parallelism.

There are no module-level globals: a ``ParallelState`` object is built once per process and
passed explicitly to whatever needs groups (layers, the RNG tracker, DeepSpeed's ``mpu``).

Rank layout follows Megatron-LM: with tensor size ``tp``, data size ``dp`` and pipeline size
``pp`` (world = tp * dp * pp) a global rank decomposes as

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one TP group are adjacent (they exchange activations every layer and should
share a node), DP groups stride by ``tp`` and pipeline stages are the outermost blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelLayout:
    """Pure rank arithmetic of a (pp, dp, tp) grid; creates no process groups."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.world_size % (self.tp_size * self.pp_size) != 0:
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size: expected a divisor of the world size "
                f"{self.world_size}, got {self.tp_size} * {self.pp_size} = {self.tp_size * self.pp_size}"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> (pp_rank, dp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {rank}")
        pp_rank, rest = divmod(rank, self.dp_size * self.tp_size)
        dp_rank, tp_rank = divmod(rest, self.tp_size)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.dp_size * self.tp_size + dp_rank * self.tp_size + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing a model replica's tensor shards (adjacent ranks)."""
        return [list(range(s, s + self.tp_size)) for s in range(0, self.world_size, self.tp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard of different replicas (gradients are averaged here)."""
        return [
            [self.rank_of(p, d, t) for d in range(self.dp_size)]
            for p in range(self.pp_size)
            for t in range(self.tp_size)
        ]

    def pp_groups(self) -> list[list[int]]:
        block = self.dp_size * self.tp_size
        return [[p * block + j for p in range(self.pp_size)] for j in range(block)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp x pp): all ranks that together hold one model replica."""
        return [
            sorted(self.rank_of(p, d, t) for p in range(self.pp_size) for t in range(self.tp_size))
            for d in range(self.dp_size)
        ]


class ParallelState:
    """This process's position in the parallel grid and its process groups.

    Build it with ``ParallelState.create`` (collective: every rank must call it, in the same
    order relative to other ``new_group`` calls), ``initialize_parallel_state`` (also sets up
    the default process group from torchrun-style env vars), ``ParallelState.single()`` for one
    process without ``torch.distributed``, or ``ParallelState.detached(tp, tp_rank)`` for
    building a TP-sharded module skeleton (e.g. on the meta device) without any groups.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        *,
        tp_group: ProcessGroup | None = None,
        dp_group: ProcessGroup | None = None,
        pp_group: ProcessGroup | None = None,
        mp_group: ProcessGroup | None = None,
        tp_ranks: list[int] | None = None,
        dp_ranks: list[int] | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(rank)
        self.tp_group = tp_group
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.mp_group = mp_group
        self.tp_ranks = tp_ranks if tp_ranks is not None else layout.tp_groups()[rank // layout.tp_size]
        self.dp_ranks = dp_ranks if dp_ranks is not None else [rank]

    # --- sizes -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def has_groups(self) -> bool:
        """False for ``single()``/``detached()`` states, which cannot communicate."""
        return self.tp_group is not None

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})"
        )

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def create(cls, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> "ParallelState":
        """Create all groups of the grid. Collective over the default process group."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelState.create needs torch.distributed initialised (see initialize_parallel_state)")
        if pipeline_parallel_size != 1:
            # The grid arithmetic supports it; the model has no pipeline schedule yet.
            raise NotImplementedError("pipeline_parallel_size > 1 is not implemented yet")
        layout = ParallelLayout(dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size)
        rank = dist.get_rank()
        mine: dict[str, tuple[ProcessGroup, list[int]]] = {}
        # new_group is collective over the whole world: every rank creates every group.
        for kind, groups in (
            ("tp", layout.tp_groups()),
            ("dp", layout.dp_groups()),
            ("pp", layout.pp_groups()),
            ("mp", layout.mp_groups()),
        ):
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = (group, ranks)
        return cls(
            layout,
            rank,
            tp_group=mine["tp"][0],
            dp_group=mine["dp"][0],
            pp_group=mine["pp"][0],
            mp_group=mine["mp"][0],
            tp_ranks=mine["tp"][1],
            dp_ranks=mine["dp"][1],
        )

    @classmethod
    def single(cls) -> "ParallelState":
        """World of one process; all communication is a no-op."""
        return cls(ParallelLayout(1), 0)

    @classmethod
    def detached(cls, tp_size: int, tp_rank: int = 0) -> "ParallelState":
        """Position ``tp_rank`` of a TP group of ``tp_size`` with no process groups.

        Only for building shard-shaped module skeletons (shapes, partition tags); running a
        forward pass with it raises.
        """
        layout = ParallelLayout(tp_size, tp_size)
        return cls(layout, tp_rank)


def initialize_parallel_state(
    tensor_parallel_size: int = 1, backend: str | None = None, pipeline_parallel_size: int = 1
) -> ParallelState:
    """Initialise ``torch.distributed`` from torchrun env vars if needed, then the grid.

    ``backend`` defaults to nccl when CUDA is available, else gloo. Without the env vars
    (plain ``python script.py``) a world of one process is assumed.
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    if tensor_parallel_size < 1 or world % tensor_parallel_size != 0:
        raise ValueError(
            f"tensor_parallel_size: expected a positive divisor of the world size {world}, "
            f"got {tensor_parallel_size}"
        )
    return ParallelState.create(tensor_parallel_size, pipeline_parallel_size)


class DeepSpeedMPU:
    """Adapter exposing a ``ParallelState`` through the ``mpu`` interface DeepSpeed queries.

    ``deepspeed.initialize(mpu=DeepSpeedMPU(state))`` uses it for data-parallel gradient
    reduction, grad-norm reduction over model-parallel ranks and checkpoint naming. The
    "model parallel" group is Megatron's tp x pp group.
    """

    def __init__(self, state: ParallelState) -> None:
        self.state = state

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup | None:
        return self.state.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (broadcast source)."""
        return self.state.tp_ranks[0]

    # model parallel (tp x pp)
    def get_model_parallel_rank(self) -> int:
        return self.state.pp_rank * self.state.tp_size + self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size * self.state.pp_size

    def get_model_parallel_group(self) -> ProcessGroup | None:
        return self.state.mp_group

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group(self) -> ProcessGroup | None:
        return self.state.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.state.dp_ranks)

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.pp_size

    def get_pipeline_model_parallel_group(self) -> ProcessGroup | None:
        return self.state.pp_group
