"""The launch helpers the Triton wrappers share (``linear.py``, ``window.py``, ``trig.py``, ``aot.py``):
block sizes and tile caps, the per-call ``ChunkPlan`` (shapes and stabilisers), ``launch`` (one
kernel launch with the feature-map arguments) and ``chunk_states`` (the state scan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MAX_CHUNK = 128
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


def kernel_chunk(chunk_size: int) -> int:
    """The chunk length the kernels use: ``chunk_size`` rounded up to a power of two in [16, 128]
    (tl.arange and tl.dot need it; the chunk length changes nothing but rounding)."""
    return min(_MAX_CHUNK, max(MIN_BLOCK, 1 << (chunk_size - 1).bit_length()))


def block_size(size: int) -> int:
    """``size`` rounded up to a power of two, at least ``MIN_BLOCK``: a kernel block covering it."""
    return max(MIN_BLOCK, 1 << (size - 1).bit_length())


# Tile caps (chosen by compiling every shipped shape for sm_80 and sm_90, benchmarks/triton_aot.py):
# the scans and chunk_grads_v's grid take blocks of at most 64 columns of F / Dv; the chunk
# kernels loop over 32-wide blocks of the dimension they contract (64-wide ones spilled 600-800 B
# per thread on sm_80). The old single full-width block needed 245,760 B of shared memory on sm_90.
_MAX_TILE = 64
LOOP_TILE = 32
# The scans are sequential over chunks: below this many programs (e.g. B = 1) their blocks shrink
# to 32 columns so that more SMs take part.
_SCAN_MIN_PROGRAMS = 256


@dataclass
class TrigMap:
    """The trig feature map the kernels compute in registers (``feature_maps/trig.py``): the
    frequencies omega [H, P, d] (fp32, contiguous), paired or not, and the feature scale."""

    omega: torch.Tensor
    paired: bool
    scale: float

    @property
    def head_dim(self) -> int:
        return self.omega.shape[2]


@dataclass
class ChunkPlan:
    """Shapes, block sizes and stabilisers of one call (the same in forward and backward)."""

    bh: int
    n: int
    feat: int
    dv: int
    chunk: int
    chunks: int
    running_max: torch.Tensor  # [BH, N] m_t
    chunk_max: torch.Tensor  # [BH, NC + 1]: log_max of the incoming state, then m at each chunk end
    trig: TrigMap | None = None  # set: the q, k given to the kernels are the raw [BH, N, d] inputs of this map

    @property
    def loop_block(self) -> int:
        """F block the chunk kernels loop over (and chunk_grads_qk's grid takes); 16 wide when they
        compute trig features (the tiles' projections and cosines take registers too)."""
        return min(block_size(self.feat), MIN_BLOCK if self.trig else LOOP_TILE)

    @property
    def dv_block(self) -> int:
        """Dv block of chunk_grads_v's grid."""
        return min(block_size(self.dv), _MAX_TILE)

    def grads_qk_blocks(self) -> tuple[int, int]:
        """(BF, BV) of ``chunk_grads_qk``: its grid over F blocks, its loop over Dv blocks."""
        return self.loop_block, min(block_size(self.dv), LOOP_TILE)

    def scan_blocks(self) -> tuple[int, int]:
        """(BF, BV) of the sequential scans: the chunk kernels' tiles, halved (down to 32 wide)
        while fewer than ``_SCAN_MIN_PROGRAMS`` programs would run (their columns are independent)."""
        # features computed in the scan (trig): 16-wide F blocks (32 spilled 24 B at BV = 64 on
        # sm_80); the F blocks share no work, while every Dv block recomputes its features
        bf, bv = min(block_size(self.feat), MIN_BLOCK if self.trig else _MAX_TILE), self.dv_block
        while self.bh * -(-self.feat // bf) * -(-self.dv // bv) < _SCAN_MIN_PROGRAMS and max(bf, bv) > 32:
            if bf >= bv:
                bf //= 2
            else:
                bv //= 2
        return bf, bv


def _map_arguments(plan: ChunkPlan) -> tuple[tuple, dict]:
    """The attention kernels' feature-map arguments (W, HEADS, DIN, trig_scale; TRIG, PAIRED, BD):
    the trig map's, or placeholders when the features are given (TRIG=False ignores them)."""
    trig = plan.trig
    if trig is None:
        return (plan.chunk_max, 1, 1, 1.0), dict(TRIG=False, PAIRED=False, BD=MIN_BLOCK)
    omega = trig.omega
    flags = dict(TRIG=True, PAIRED=trig.paired, BD=projection_block(trig.head_dim))
    return (omega, omega.shape[0], trig.head_dim, trig.scale), flags


def projection_block(head_dim: int) -> int:
    """Head-dim block over which the kernels accumulate trig projections (``kernels._trig_projs``):
    whole [C, 128] input tiles made chunk_outputs spill at the 1.3B shape."""
    return min(block_size(head_dim), LOOP_TILE)


def launch(kern, kernel: str, grid: tuple[int, ...], plan: ChunkPlan, *args, **constexprs) -> None:
    """``kern.<kernel>[grid](*args)`` with the plan's chunk length and feature-map arguments."""
    # fp32 inputs: tf32 tensor cores (about 1e-3 relative); half inputs ignore PREC (their dot
    # operands are already half). The interpreter computes every dot in fp32. num_warps and
    # num_stages come from the kernel's autotuner (``launch_configs``).
    map_args, map_flags = _map_arguments(plan)
    getattr(kern, kernel)[grid](*args, *map_args, CHUNK=plan.chunk, PREC="tf32", **map_flags, **constexprs)


def chunk_plan(ls: torch.Tensor, log_max0: torch.Tensor, feat: int, dv: int, chunk_size: int) -> ChunkPlan:
    """ls [BH, N] fp32 key log-scales, log_max0 [BH] -> the stabilisers (constants for autograd)."""
    bh, n = ls.shape
    chunk = kernel_chunk(chunk_size)
    chunks = -(-n // chunk)
    running_max = torch.maximum(ls.detach().cummax(dim=-1).values, log_max0.detach().unsqueeze(-1)).contiguous()
    ends = torch.arange(1, chunks + 1, device=ls.device) * chunk - 1
    chunk_max = torch.cat([log_max0.detach().unsqueeze(-1), running_max[:, ends.clamp(max=n - 1)]], dim=-1).contiguous()
    return ChunkPlan(bh, n, feat, dv, chunk, chunks, running_max, chunk_max)


def chunk_states(kern, k, v, ls, plan: ChunkPlan, kv0, z0):
    """States entering each chunk [BH, NC, F, Dv], [BH, NC, F] and the final kv, k_sum."""
    f32 = dict(device=k.device, dtype=torch.float32)
    states = torch.empty(plan.bh, plan.chunks, plan.feat, plan.dv, **f32)
    sums = torch.empty(plan.bh, plan.chunks, plan.feat, **f32)
    kv, k_sum = torch.empty(plan.bh, plan.feat, plan.dv, **f32), torch.empty(plan.bh, plan.feat, **f32)
    bf, bv = plan.scan_blocks()
    launch(
        kern, "chunk_states", (plan.bh, -(-plan.feat // bf), -(-plan.dv // bv)), plan,
        k, v, ls, plan.chunk_max, kv0, z0, states, sums, kv, k_sum, plan.n, plan.feat, plan.dv, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    return states, sums, kv, k_sum
