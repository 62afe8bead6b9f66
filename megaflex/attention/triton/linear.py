"""Torch glue of the Triton kernels: the launches (with ``launch.py``'s helpers), the autograd.Function,
``triton_linear_attention``.

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

from types import ModuleType

import torch

from ..base import LinearAttentionState
from ..decay import folded
from ..inputs import validate_linear_attention_inputs
from ..normalize import check_normalization, kernel_flags
from .launch import MIN_BLOCK, ChunkPlan, block_size, chunk_plan, chunk_states, launch, projection_block
from .tuning import interpreter_enabled

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def attention_forward(
    q, k, ls, v, kv0, z0, plan: ChunkPlan, normalization: str, eps: float, out_dtype: torch.dtype, kern=None
):
    """[BH, N, *] contiguous inputs -> (out [BH, N, Dv] in out_dtype, final kv [BH, F, Dv], k_sum [BH, F]).
    ``kern``: the kernels module (default ``kernels_for(q.device)``; the AOT harness records launches)."""
    kern = kern or kernels_for(q.device)
    states, sums, kv, k_sum = chunk_states(kern, k, v, ls, plan, kv0, z0)
    out = torch.empty(plan.bh, plan.n, plan.dv, device=q.device, dtype=out_dtype)
    launch(
        kern, "chunk_outputs", (plan.chunks, plan.bh), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, out, out, out, out,
        plan.n, plan.feat, plan.dv, plan.chunks, eps,
        BF=plan.loop_block, BV=block_size(plan.dv), **kernel_flags(normalization), BACKWARD=False,
    )  # fmt: skip
    return out, kv, k_sum


def attention_backward(
    q, k, ls, v, kv0, z0, plan: ChunkPlan, normalization: str, eps: float, d_out, d_kv, d_k_sum, kern=None
):
    """Gradients ([BH, ...]; q, k, v in their own dtype, the rest fp32) of q, k, ls, v and of the incoming kv, k_sum.
    With ``plan.trig`` the first two are the fp32 gradients of the q and k features [BH, N, F]."""
    kern = kern or kernels_for(q.device)
    f32 = dict(device=q.device, dtype=torch.float32)
    states, sums, _, _ = chunk_states(kern, k, v, ls, plan, kv0, z0)
    d_out = torch.zeros(plan.bh, plan.n, plan.dv, **f32) if d_out is None else d_out.contiguous()
    d_num = torch.empty(plan.bh, plan.n, plan.dv, **f32)
    d_den = torch.empty(plan.bh, plan.n, **f32)
    launch(
        kern, "chunk_outputs", (plan.chunks, plan.bh), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, d_out, d_out, d_num, d_den,
        plan.n, plan.feat, plan.dv, plan.chunks, eps,
        BF=plan.loop_block, BV=block_size(plan.dv), **kernel_flags(normalization), BACKWARD=True,
    )  # fmt: skip
    d_kv = torch.zeros(plan.bh, plan.feat, plan.dv, **f32) if d_kv is None else d_kv.contiguous()
    d_k_sum = torch.zeros(plan.bh, plan.feat, **f32) if d_k_sum is None else d_k_sum.contiguous()
    d_states, d_sums = torch.empty_like(states), torch.empty_like(sums)
    d_kv0, d_z0 = torch.empty(plan.bh, plan.feat, plan.dv, **f32), torch.empty(plan.bh, plan.feat, **f32)
    bf, bv = plan.scan_blocks()
    launch(
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
    launch(
        kern, "chunk_grads_qk", (plan.chunks, plan.bh, -(-plan.feat // bf)), plan,
        q, k, v, ls, plan.running_max, plan.chunk_max, states, sums, d_num, d_den, d_states, d_sums, dq, dk, dls_parts,
        plan.n, plan.feat, plan.dv, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    launch(
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
    bj = MIN_BLOCK  # [BJ, d] frequency blocks: 16 rows keep dW's two accumulators in registers at d = 128
    blocks = -(-half // bj)
    dx_parts = torch.empty(blocks, plan.bh, plan.n, trig.head_dim, **f32)
    d_omega = torch.empty(plan.bh, *trig.omega.shape[1:], **f32)
    kern.trig_grads[(plan.bh, blocks)](
        x, trig.omega, d_features, dx_parts, d_omega, plan.n, plan.feat, trig.head_dim, trig.omega.shape[0], plan.chunks,
        trig.scale, CHUNK=plan.chunk, BJ=bj, BD=block_size(trig.head_dim), BK=projection_block(trig.head_dim), PAIRED=trig.paired, PREC="tf32",
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
    plan = chunk_plan(ls, log_max0, feat, dv, chunk_size)
    flat = (qf.reshape(bh, n, width).contiguous(), kf.reshape(bh, n, width).contiguous(), ls, v.reshape(bh, n, dv).contiguous())
    return flat, kv0, z0, plan


def check_triton_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: the triton backend takes fp16, bf16 or fp32, got {t.dtype} (use attention_backend='torch')")


def check_options(normalization: str, chunk_size: int, eps: float) -> None:
    check_normalization(normalization)  # chunk_outputs fuses every one (kernel_flags)
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
