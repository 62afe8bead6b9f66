"""Process-group bookkeeping for tensor, context and pipeline parallelism.

There are no module-level globals: a ``ParallelState`` object is built once per process and
passed explicitly to whatever needs groups (layers, the RNG tracker, DeepSpeed's ``mpu``).

``ParallelDims`` is the one place that knows the grid: built once from the configured sizes
and the world size (TP x CP x DP x PP = world; DP is what is left), it validates them, and the
model-fit check (heads / MLP width divisible by TP) lives here too. Rank layout follows
Megatron-LM, with context parallelism between tensor and data parallelism:

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so the ranks of one TP group are adjacent (they exchange activations every layer and should
share a node), the CP ranks of one replica come next (one small all-gather per layer), DP groups
stride by ``cp * tp`` and pipeline stages are the outermost blocks. CP ranks hold the same
parameters (different slices of one sequence), so ZeRO/DDP reduce over the combined DP x CP group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaflex.model.layers import check_model_fit
from megaflex.parallel.launcher_env import local_cuda_device
from megaflex.parallel.rendezvous import free_port

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelDims:
    """Pure rank arithmetic of a (pp, dp, cp, tp) grid; creates no process groups."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "cp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        model = self.tp_size * self.cp_size * self.pp_size
        if self.world_size % model != 0:
            raise ValueError(
                f"tensor_parallel_size x context_parallel_size x pipeline_parallel_size: expected a divisor of "
                f"the world size {self.world_size}, got {self.tp_size} x {self.cp_size} x {self.pp_size} = {model}"
            )

        if self.pp_size > 1 and self.cp_size > 1:
            # DeepSpeed's pipeline topology has no context axis, and each stage would need the
            # CP state exchange of its own blocks: not wired up.
            raise ValueError(
                f"pipeline_parallel_size: context parallelism and pipeline parallelism are not supported together, "
                f"got pipeline_parallel_size {self.pp_size} with context_parallel_size {self.cp_size}"
            )

    @classmethod
    def for_model(
        cls, world_size: int, tp_size: int, cp_size: int, *, num_heads: int, ffn_hidden_size: int,
        pp_size: int = 1, num_layers: int | None = None,
    ) -> "ParallelDims":
        """The grid of a run, validated once against the world and the model it will split."""
        dims = cls(world_size, tp_size, pp_size, cp_size)
        dims.check_model_fit(num_heads, ffn_hidden_size, num_layers)
        return dims

    def check_model_fit(self, num_heads: int, ffn_hidden_size: int, num_layers: int | None = None) -> None:
        """ValueError unless every TP rank gets whole heads and an equal MLP slice, and every
        pipeline stage at least one block (``num_layers``, when given)."""
        check_model_fit(num_heads, ffn_hidden_size, self.tp_size)
        if num_layers is not None and num_layers < self.pp_size:
            raise ValueError(
                f"pipeline_parallel_size: expected at most model.num_layers ({num_layers}) stages "
                f"(each holds at least one block), got {self.pp_size}"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size * self.pp_size)

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """Global rank -> (pp_rank, dp_rank, cp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {rank}")
        pp_rank, rest = divmod(rank, self.dp_size * self.cp_size * self.tp_size)
        dp_rank, rest = divmod(rest, self.cp_size * self.tp_size)
        cp_rank, tp_rank = divmod(rest, self.tp_size)
        return pp_rank, dp_rank, cp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def _grid(self) -> list[tuple[int, int, int, int]]:
        return [self.coords(r) for r in range(self.world_size)]

    def _groups_varying(self, *axes: int) -> list[list[int]]:
        """Ranks grouped by equal coordinates on every axis not in ``axes`` (0 pp, 1 dp, 2 cp, 3 tp)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(self._grid()):
            key = tuple(v for i, v in enumerate(c) if i not in axes)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing a model replica's tensor shards (adjacent ranks)."""
        return self._groups_varying(3)

    def cp_groups(self) -> list[list[int]]:
        """Ranks holding consecutive slices of the same sequences (same shards, same samples)."""
        return self._groups_varying(2)

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard and sequence slice of different replicas."""
        return self._groups_varying(1)

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks holding the same parameter shard: gradients are averaged (ZeRO partitions) here."""
        return self._groups_varying(1, 2)

    def pp_groups(self) -> list[list[int]]:
        return self._groups_varying(0)

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp x pp): all ranks that together hold one model replica."""
        return self._groups_varying(0, 3)



class ParallelState:
    """This process's position in the parallel grid and its process groups.

    Build it with ``ParallelState.create`` (collective: every rank must call it, in the same
    order relative to other ``new_group`` calls), ``initialize_parallel_state`` (also sets up
    the default process group from torchrun-style env vars), ``ParallelState.single()`` for one
    process without ``torch.distributed``, or ``ParallelState.detached(tp, tp_rank)`` for
    building a TP-sharded module skeleton (e.g. on the meta device) without any groups.
    """

    def __init__(
        self, dims: ParallelDims, rank: int, groups: dict[str, tuple[ProcessGroup | None, list[int]]] | None = None
    ) -> None:
        self.dims = dims
        self.rank = rank
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = dims.coords(rank)
        self._communicates = groups is not None
        groups = groups or {}
        self.tp_group, self.tp_ranks = groups.get("tp", (None, dims.tp_groups()[rank // dims.tp_size]))
        self.cp_group, self.cp_ranks = groups.get("cp", (None, [rank]))
        self.dp_group, self.dp_ranks = groups.get("dp", (None, [rank]))
        self.dp_cp_group, self.dp_cp_ranks = groups.get("dp_cp", (None, [rank]))
        self.pp_group, _ = groups.get("pp", (None, [rank]))
        self.mp_group, _ = groups.get("mp", (None, [rank]))

    # --- sizes -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp_size(self) -> int:
        return self.dims.tp_size

    @property
    def cp_size(self) -> int:
        return self.dims.cp_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def pp_size(self) -> int:
        return self.dims.pp_size

    @property
    def has_groups(self) -> bool:
        """False for ``single()``/``detached()`` states, which cannot communicate. (A group of
        one rank is None either way: collectives over it are skipped, ``megaflex.parallel.comm``.)"""
        return self._communicates

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})"
        )

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def create(
        cls, tensor_parallel_size: int | ParallelDims = 1, pipeline_parallel_size: int = 1, context_parallel_size: int = 1
    ) -> "ParallelState":
        """Create all groups of the grid (``ParallelDims`` or its sizes). Collective over the world."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelState.create needs torch.distributed initialised (see initialize_parallel_state)")
        if isinstance(tensor_parallel_size, ParallelDims):
            dims = tensor_parallel_size
            if dims.world_size != dist.get_world_size():
                raise ValueError(f"dims.world_size: expected the world size {dist.get_world_size()}, got {dims.world_size}")
        else:
            dims = ParallelDims(dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
        rank = dist.get_rank()
        mine: dict[str, tuple[ProcessGroup | None, list[int]]] = {}
        # new_group is collective over the whole world: every rank creates every group, in the same
        # order. Groups of one rank are None (nothing to talk to; at TP = CP = 1 they would be 4W
        # communicators), and a rank set shared by two kinds (dp and dp_cp when CP = 1) is built once.
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for kind, groups in (
            ("tp", dims.tp_groups()),
            ("cp", dims.cp_groups()),
            ("dp", dims.dp_groups()),
            ("dp_cp", dims.dp_cp_groups()),
            ("pp", dims.pp_groups()),
            ("mp", dims.mp_groups()),
        ):
            for ranks in groups:
                group = None
                if len(ranks) > 1:
                    if tuple(ranks) not in made:
                        made[tuple(ranks)] = dist.new_group(ranks)
                    group = made[tuple(ranks)]
                if rank in ranks:
                    mine[kind] = (group, ranks)
        return cls(dims, rank, mine)

    @classmethod
    def single(cls) -> "ParallelState":
        """World of one process; all communication is a no-op."""
        return cls(ParallelDims(1), 0)

    @classmethod
    def detached(cls, tp_size: int, tp_rank: int = 0) -> "ParallelState":
        """Position ``tp_rank`` of a TP group of ``tp_size`` with no process groups.

        Only for building shard-shaped module skeletons (shapes, partition tags); running a
        forward pass with it raises.
        """
        return cls(ParallelDims(tp_size, tp_size), tp_rank)


def initialize_parallel_state(
    tensor_parallel_size: int = 1, backend: str | None = None, pipeline_parallel_size: int = 1, context_parallel_size: int = 1
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
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(local_cuda_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
        dist.init_process_group(backend=backend)
    dims = ParallelDims(dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
    return ParallelState.create(dims)


class DeepSpeedMPU:
    """Adapter exposing a ``ParallelState`` through the ``mpu`` interface DeepSpeed queries.

    ``deepspeed.initialize(mpu=DeepSpeedMPU(state))`` uses it for data-parallel gradient
    reduction, grad-norm reduction over model-parallel ranks and checkpoint naming. The
    "model parallel" group is Megatron's tp x pp group; DeepSpeed's "data parallel" group is
    DP x CP (CP ranks hold identical parameters, so ZeRO partitions and reduces over both).

    DeepSpeed passes every group it gets straight to torch.distributed, where None is the world:
    a group of one rank (None in ``ParallelState``) is handed over as a group of this rank alone,
    built on first use with group-local synchronisation (the other ranks take no part).
    """

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self._alone: ProcessGroup | None = None

    def _real(self, group: ProcessGroup | None) -> ProcessGroup | None:
        if group is not None or not self.state.has_groups:
            return group
        if self._alone is None:
            self._alone = dist.new_group([self.state.rank], use_local_synchronization=True)
        return self._alone

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup | None:
        return self._real(self.state.tp_group)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (broadcast source)."""
        return self.state.tp_ranks[0]

    # model parallel (tp x pp)
    def get_model_parallel_rank(self) -> int:
        return self.state.pp_rank * self.state.tp_size + self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size * self.state.pp_size

    def get_model_parallel_group(self) -> ProcessGroup | None:
        return self._real(self.state.mp_group)

    # data parallel (DP x CP: every rank holding the same parameter shard)
    def get_data_parallel_rank(self) -> int:
        return self.state.dp_cp_ranks.index(self.state.rank)

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size * self.state.cp_size

    def get_data_parallel_group(self) -> ProcessGroup | None:
        return self._real(self.state.dp_cp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.state.dp_cp_ranks)

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.pp_size

    def get_pipeline_model_parallel_group(self) -> ProcessGroup | None:
        return self._real(self.state.pp_group)


def deepspeed_mpu(state: ParallelState) -> DeepSpeedMPU | None:
    """What to pass as ``deepspeed.initialize(mpu=...)``: None without model parallelism.

    DeepSpeed all-reduces gradient norms over ``mpu.get_model_parallel_group()`` without checking
    its size, and a group of one rank is None here (which torch reads as the world). At TP = PP = 1
    DeepSpeed needs no mpu: its data-parallel group is then the world, which is DP x CP."""
    return DeepSpeedMPU(state) if state.tp_size * state.pp_size > 1 else None
