"""Torch glue of the Triton kernels: launches, the autograd.Function, ``triton_linear_attention``.

Forward: the running max m_t (one ``cummax``) and the chunk stabilisers in torch, then
``chunk_states`` (state entering every chunk + final state) and ``chunk_outputs``. Saved for
backward: the inputs and the [B, H, N] running max only. Backward recomputes the chunk states
(one more O(N F Dv) scan, cheaper than keeping N / C states of F x Dv fp32 alive between forward
and backward: at F = 128, C = 64 those weigh 4x a bf16 copy of the features), turns the output
gradient into numerator/denominator gradients, scans the state gradients in reverse, and
computes dq, dk, dv, dkls per chunk: the C x C blocks are recomputed, never stored.

On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before
the first use); ``kernels_for`` raises a clear error otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..base import NORMALIZATIONS, OUTPUT_RMS_CAP, LinearAttentionState
from ..decay import folded
from ..inputs import validate_linear_attention_inputs
from .tuning import interpreter_enabled

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_CHUNK = 128
_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_KERNELS: ModuleType | None = None
_KERNELS_INTERPRETED = False


def kernels_for(device: torch.device) -> ModuleType:
    """The kernels module, imported on first use; RuntimeError if it cannot run on ``device``."""
    global _KERNELS, _KERNELS_INTERPRETED
    if not triton_available():
        raise RuntimeError("attention_backend='triton' needs the triton package: pip install 'megaflex[gpu]'")
    if _KERNELS is None:
        from . import linear_kernels as kernels

        _KERNELS, _KERNELS_INTERPRETED = kernels, interpreter_enabled()
    if device.type == "cpu" and not _KERNELS_INTERPRETED:
        raise RuntimeError(
            "attention_backend='triton' on CPU tensors runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before megaflex's Triton kernels are first used (or use attention_backend='torch'/'auto' on CPU)"
        )
    if device.type != "cpu" and _KERNELS_INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 was set when the Triton kernels were loaded: they cannot run on the GPU")
    return _KERNELS


def kernel_chunk(chunk_size: int) -> int:
    """The chunk length the kernels use: ``chunk_size`` rounded up to a power of two in [16, 128]
    (tl.arange and tl.dot need it; the chunk length changes nothing but rounding)."""
    return min(_MAX_CHUNK, max(_MIN_BLOCK, 1 << (chunk_size - 1).bit_length()))


def _block(size: int) -> int:
    return max(_MIN_BLOCK, 1 << (size - 1).bit_length())


# Tile caps (chosen by compiling every shipped shape for sm_80 and sm_90, benchmarks/triton_aot.py):
# the scans and chunk_grads_v's grid take blocks of at most 64 columns of F / Dv; the chunk
# kernels loop over 32-wide blocks of the dimension they contract (64-wide ones spilled 600-800 B
# per thread on sm_80). The old single full-width block needed 245,760 B of shared memory on sm_90.
_MAX_TILE = 64
_LOOP_TILE = 32
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
        return min(_block(self.feat), _MIN_BLOCK if self.trig else _LOOP_TILE)

    @property
    def dv_block(self) -> int:
        """Dv block of chunk_grads_v's grid."""
        return min(_block(self.dv), _MAX_TILE)

    def grads_qk_blocks(self) -> tuple[int, int]:
        """(BF, BV) of ``chunk_grads_qk``: its grid over F blocks, its loop over Dv blocks."""
        return self.loop_block, min(_block(self.dv), _LOOP_TILE)

    def scan_blocks(self) -> tuple[int, int]:
        """(BF, BV) of the sequential scans: the chunk kernels' tiles, halved (down to 32 wide)
        while fewer than ``_SCAN_MIN_PROGRAMS`` programs would run (their columns are independent)."""
        # features computed in the scan (trig): 16-wide F blocks (32 spilled 24 B at BV = 64 on
        # sm_80); the F blocks share no work, while every Dv block recomputes its features
        bf, bv = min(_block(self.feat), _MIN_BLOCK if self.trig else _MAX_TILE), self.dv_block
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
        return (plan.chunk_max, 1, 1, 1.0), dict(TRIG=False, PAIRED=False, BD=_MIN_BLOCK)
    omega = trig.omega
    flags = dict(TRIG=True, PAIRED=trig.paired, BD=_projection_block(trig.head_dim))
    return (omega, omega.shape[0], trig.head_dim, trig.scale), flags


def _projection_block(head_dim: int) -> int:
    """Head-dim block over which the kernels accumulate trig projections (``kernels._trig_projs``):
    whole [C, 128] input tiles made chunk_outputs spill at the 1.3B shape."""
    return min(_block(head_dim), _LOOP_TILE)


def _launch(kern, kernel: str, grid: tuple[int, ...], plan: ChunkPlan, *args, **constexprs) -> None:
    # fp32 inputs: tf32 tensor cores (about 1e-3 relative); half inputs ignore PREC (their dot
    # operands are already half). The interpreter computes every dot in fp32. num_warps and
    # num_stages come from the kernel's autotuner (``launch_configs``).
    map_args, map_flags = _map_arguments(plan)
    getattr(kern, kernel)[grid](*args, *map_args, CHUNK=plan.chunk, PREC="tf32", **map_flags, **constexprs)


def _plan(ls: torch.Tensor, log_max0: torch.Tensor, feat: int, dv: int, chunk_size: int) -> ChunkPlan:
    """ls [BH, N] fp32 key log-scales, log_max0 [BH] -> the stabilisers (constants for autograd)."""
    bh, n = ls.shape
    chunk = kernel_chunk(chunk_size)
    chunks = -(-n // chunk)
    running_max = torch.maximum(ls.detach().cummax(dim=-1).values, log_max0.detach().unsqueeze(-1)).contiguous()
    ends = torch.arange(1, chunks + 1, device=ls.device) * chunk - 1
    chunk_max = torch.cat([log_max0.detach().unsqueeze(-1), running_max[:, ends.clamp(max=n - 1)]], dim=-1).contiguous()
    return ChunkPlan(bh, n, feat, dv, chunk, chunks, running_max, chunk_max)


def _chunk_states(kern, k, v, ls, plan: ChunkPlan, kv0, z0):
    """States entering each chunk [BH, NC, F, Dv], [BH, NC, F] and the final kv, k_sum."""
    f32 = dict(device=k.device, dtype=torch.float32)
    states = torch.empty(plan.bh, plan.chunks, plan.feat, plan.dv, **f32)
    sums = torch.empty(plan.bh, plan.chunks, plan.feat, **f32)
    kv, k_sum = torch.empty(plan.bh, plan.feat, plan.dv, **f32), torch.empty(plan.bh, plan.feat, **f32)
    bf, bv = plan.scan_blocks()
    _launch(
        kern, "chunk_states", (plan.bh, -(-plan.feat // bf), -(-plan.dv // bv)), plan,
        k, v, ls, plan.chunk_max, kv0, z0, states, sums, kv, k_sum, plan.n, plan.feat, plan.dv, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    return states, sums, kv, k_sum


def attention_forward(
    q, k, ls, v, kv0, z0, plan: ChunkPlan, normalization: str, eps: float, out_dtype: torch.dtype, kern=None
):
    """[BH, N, *] contiguous inputs -> (out [BH, N, Dv] in out_dtype, final kv [BH, F, Dv], k_sum [BH, F]).
    ``kern``: the kernels module (default ``kernels_for(q.device)``; the AOT harness records launches)."""
    kern = kern or kernels_for(q.device)
    states, sums, kv, k_sum = _chunk_states(kern, k, v, ls, plan, kv0, z0)
    out = torch.empty(plan.bh, plan.n, plan.dv, device=q.device, dtype=out_dtype)
    _launch(
        kern, "chunk_outputs", (plan.chunks, plan.bh), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, out, out, out, out,
        plan.n, plan.feat, plan.dv, plan.chunks, eps,
        BF=plan.loop_block, BV=_block(plan.dv), RMS=normalization == "rms", CAP=_cap(normalization), BACKWARD=False,
    )  # fmt: skip
    return out, kv, k_sum


def attention_backward(
    q, k, ls, v, kv0, z0, plan: ChunkPlan, normalization: str, eps: float, d_out, d_kv, d_k_sum, kern=None
):
    """Gradients ([BH, ...]; q, k, v in their own dtype, the rest fp32) of q, k, ls, v and of the incoming kv, k_sum.
    With ``plan.trig`` the first two are the fp32 gradients of the q and k features [BH, N, F]."""
    kern = kern or kernels_for(q.device)
    f32 = dict(device=q.device, dtype=torch.float32)
    states, sums, _, _ = _chunk_states(kern, k, v, ls, plan, kv0, z0)
    d_out = torch.zeros(plan.bh, plan.n, plan.dv, **f32) if d_out is None else d_out.contiguous()
    d_num = torch.empty(plan.bh, plan.n, plan.dv, **f32)
    d_den = torch.empty(plan.bh, plan.n, **f32)
    _launch(
        kern, "chunk_outputs", (plan.chunks, plan.bh), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, d_out, d_out, d_num, d_den,
        plan.n, plan.feat, plan.dv, plan.chunks, eps,
        BF=plan.loop_block, BV=_block(plan.dv), RMS=normalization == "rms", CAP=_cap(normalization), BACKWARD=True,
    )  # fmt: skip
    d_kv = torch.zeros(plan.bh, plan.feat, plan.dv, **f32) if d_kv is None else d_kv.contiguous()
    d_k_sum = torch.zeros(plan.bh, plan.feat, **f32) if d_k_sum is None else d_k_sum.contiguous()
    d_states, d_sums = torch.empty_like(states), torch.empty_like(sums)
    d_kv0, d_z0 = torch.empty(plan.bh, plan.feat, plan.dv, **f32), torch.empty(plan.bh, plan.feat, **f32)
    bf, bv = plan.scan_blocks()
    _launch(
        kern, "chunk_state_grads", (plan.bh, -(-plan.feat // bf), -(-plan.dv // bv)), plan,
        q, plan.running_max, plan.chunk_max, d_num, d_den, d_kv, d_k_sum, d_states, d_sums, d_kv0, d_z0,
        plan.n, plan.feat, plan.dv, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    # gradients leave in the inputs' dtypes (the kernel casts on store): no fp32 copies of them
    dv = torch.empty_like(v)
    if plan.trig is None:
        dq, dk = torch.empty_like(q), torch.empty_like(k)
    else:  # gradients of the features computed in the kernels, fp32 [BH, N, F]: the map's backward input
        dq, dk = torch.empty(plan.bh, plan.n, plan.feat, **f32), torch.empty(plan.bh, plan.n, plan.feat, **f32)
    bf, bv = plan.grads_qk_blocks()
    dls_parts = torch.empty(-(-plan.feat // bf), plan.bh, plan.n, **f32)  # one partial sum per F block
    _launch(
        kern, "chunk_grads_qk", (plan.chunks, plan.bh, -(-plan.feat // bf)), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, d_num, d_den, d_states, d_sums, dq, dk, dls_parts,
        plan.n, plan.feat, plan.dv, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    _launch(
        kern, "chunk_grads_v", (plan.chunks, plan.bh, -(-plan.dv // plan.dv_block)), plan,
        q, k, ls, plan.running_max, plan.chunk_max, d_num, d_states, dv, plan.n, plan.feat, plan.dv, plan.chunks,
        BF=plan.loop_block, BV=plan.dv_block,
    )  # fmt: skip
    return dq, dk, dls_parts.sum(0), dv, d_kv0, d_z0


def map_backward(x: torch.Tensor, d_features: torch.Tensor, plan: ChunkPlan, kern=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The trig map's backward (``trig_grads``): x [BH, N, d], dL/dfeatures [BH, N, F] fp32 ->
    (dL/dx [BH, N, d] fp32, dL/domega per (batch, head) [BH, P, d] fp32)."""
    kern = kern or kernels_for(x.device)
    trig = plan.trig
    f32 = dict(device=x.device, dtype=torch.float32)
    half = plan.feat // 2
    bj = _MIN_BLOCK  # [BJ, d] frequency blocks: 16 rows keep dW's two accumulators in registers at d = 128
    blocks = -(-half // bj)
    dx_parts = torch.empty(blocks, plan.bh, plan.n, trig.head_dim, **f32)
    d_omega = torch.empty(plan.bh, *trig.omega.shape[1:], **f32)
    kern.trig_grads[(plan.bh, blocks)](
        x, trig.omega, d_features, dx_parts, d_omega, plan.n, plan.feat, trig.head_dim, trig.omega.shape[0], plan.chunks,
        trig.scale, CHUNK=plan.chunk, BJ=bj, BD=_block(trig.head_dim), BK=_projection_block(trig.head_dim), PAIRED=trig.paired, PREC="tf32",
    )  # fmt: skip
    return dx_parts.sum(0), d_omega


def flat_inputs(qf, kf, kls, v, initial_state: LinearAttentionState | None, chunk_size: int, feat: int | None = None):
    """Contiguous [BH, N, *] views, fp32 log-scales, the fp32 incoming state and the plan.
    ``feat``: the feature dim when qf, kf are the raw inputs of a map the kernels compute."""
    batch, heads, n, width = qf.shape
    feat = width if feat is None else feat
    bh, dv = batch * heads, v.shape[-1]
    f32 = dict(device=qf.device, dtype=torch.float32)
    ls = torch.zeros(bh, n, **f32) if kls is None else kls.reshape(bh, n).float().contiguous()
    if initial_state is None:
        kv0, z0 = torch.zeros(bh, feat, dv, **f32), torch.zeros(bh, feat, **f32)
        log_max0 = torch.full((bh,), float("-inf"), **f32)
    else:
        kv0 = initial_state.kv.reshape(bh, feat, dv).float().contiguous()
        z0 = initial_state.k_sum.reshape(bh, feat).float().contiguous()
        log_max0 = initial_state.log_max.reshape(bh).float()
    plan = _plan(ls, log_max0, feat, dv, chunk_size)
    flat = (qf.reshape(bh, n, width).contiguous(), kf.reshape(bh, n, width).contiguous(), ls, v.reshape(bh, n, dv).contiguous())
    return flat, kv0, z0, plan


def check_triton_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: the triton backend takes fp16, bf16 or fp32, got {t.dtype} (use attention_backend='torch')")


def _cap(normalization: str) -> float:
    """``chunk_outputs``' CAP: the output RMS ceiling of "capped_denominator", 0 for the others."""
    return OUTPUT_RMS_CAP if normalization == "capped_denominator" else 0.0


def check_options(normalization: str, chunk_size: int, eps: float) -> None:
    if normalization not in NORMALIZATIONS:  # chunk_outputs fuses every one (RMS, CAP)
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")


class _TritonLinearAttention(torch.autograd.Function):
    """(qf, kf, ls, v, kv0, k_sum0, plan, normalization, eps) -> (out, kv, k_sum), all [BH, ...]."""

    @staticmethod
    def forward(ctx, q, k, ls, v, kv0, z0, plan, normalization, eps):  # type: ignore[override]
        out, kv, k_sum = attention_forward(q, k, ls, v, kv0, z0, plan, normalization, eps, v.dtype)
        ctx.save_for_backward(q, k, ls, v, kv0, z0)
        ctx.plan, ctx.normalization, ctx.eps = plan, normalization, eps
        ctx.set_materialize_grads(False)
        return out, kv, k_sum

    @staticmethod
    def backward(ctx, d_out, d_kv, d_k_sum):  # type: ignore[override]
        q, k, ls, v, kv0, z0 = ctx.saved_tensors
        dq, dk, dls, dv, d_kv0, d_z0 = attention_backward(
            q, k, ls, v, kv0, z0, ctx.plan, ctx.normalization, ctx.eps, d_out, d_kv, d_k_sum
        )
        return dq, dk, dls, dv, d_kv0, d_z0, None, None, None


def final_state(kv, k_sum, plan: ChunkPlan, shape: tuple[int, int], offset: int) -> LinearAttentionState:
    """[BH, ...] final sums -> the LinearAttentionState [B, H, ...] after the last token."""
    batch, heads = shape
    return LinearAttentionState(
        kv=kv.view(batch, heads, plan.feat, plan.dv),
        k_sum=k_sum.view(batch, heads, plan.feat),
        log_max=plan.chunk_max[:, -1].view(batch, heads),
        offset=offset,
    )


def triton_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """The chunked form (``chunked_linear_attention``'s signature and contract) in Triton kernels:
    qf, kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv] -> (out in v.dtype, fp32 state).
    Differentiable w.r.t. qf, kf, kls, v, log_decay and the initial state's kv, k_sum. The decay
    (``log_decay`` [H]) is folded into kls and the state (``decay.folded``): the kernels are unchanged."""
    validate_linear_attention_inputs(
        qf, kf, kls, v, normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps,
        log_decay=log_decay,
    )
    if log_decay is not None:
        return folded(triton_linear_attention, qf, kf, kls, v, log_decay, normalization=normalization,
                      chunk_size=chunk_size, initial_state=initial_state, eps=eps)  # fmt: skip
    check_options(normalization, chunk_size, eps)
    for name, t in (("qf", qf), ("kf", kf), ("v", v)):
        check_triton_dtype(t, name)
    batch, heads, n, _ = qf.shape
    (q, k, ls, vv), kv0, z0, plan = flat_inputs(qf, kf, kls, v, initial_state, chunk_size)
    out, kv, k_sum = _TritonLinearAttention.apply(q, k, ls, vv, kv0, z0, plan, normalization, eps)
    offset = (0 if initial_state is None else initial_state.offset) + n
    return out.view(batch, heads, n, plan.dv), final_state(kv, k_sum, plan, (batch, heads), offset)
