"""GPU backend of the chunked form on flash-linear-attention's ``chunk_simple_gla``
(``attention_backend="fla"``; optional dependency, extra "gpu").

megaflex's own Triton kernels (``attention/triton/``) are the default GPU path ("auto" on CUDA
tensors); "fla" is the configurable alternative with a GPU-proven kernel, and the comparison in
``benchmarks/gpu_check``'s kernel sweep. Never used on CPU tensors. The kernel itself has
not been run in this repository's CI (no GPU there); the mapping below is tested on CPU against
the quadratic reference with a plain scan standing in for the kernel
(tests/attention/test_attention_chunked.py).

Mapping of the log-space stabiliser onto scalar-gated linear attention (GLA): with the running
max m_t (m_0 = state.log_max),

    exp(kls_s - m_t) = exp(kls_s - m_s) * prod_{u=s+1..t} exp(m_{u-1} - m_u)

so the contract's weights are GLA with keys k'_s = exp(kls_s - m_s) kf_s (scale <= 1) and
log-space gates g_u = m_{u-1} - m_u <= 0: every exponent the kernel forms is <= 0. The GLA state
after token t is then exactly the contract's kv relative to m_t. The denominator rides along as a
ones column of v (for the denominator normalisations; for "rms" k_sum is one reduction).

Precision: features and v go to the kernel in their own dtype (bf16 under bf16 training: no fp32
copies saved for the backward); the kernel accumulates its products and the carried state in fp32
(fla's ``chunk_fwd_h`` keeps the running state in fp32 registers and returns the final state in
fp32; the per-chunk states its output kernel reads are stored in the input dtype), and the gates,
the initial state, the stabiliser and the normalisation stay in fp32. The scaled keys are formed
in fp32 and rounded once. The output (and so the denominator column) comes back in v's dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..base import LinearAttentionState, accumulation_dtype, fp32_inputs
from ..decay import folded
from ..inputs import validate_linear_attention_inputs
from ..normalize import normalize_output, reads_denominator

# (q, k, v [B, T, H, *], g [B, T, H], scale, initial_state [B, H, K, V] | None, output_final_state)
#   -> (o [B, T, H, V], final_state [B, H, K, V]); the signature of fla.ops.simple_gla.chunk_simple_gla
GlaFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


def _fla_chunk_simple_gla() -> GlaFn:
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # optional dependency (extra "gpu")
    except ImportError as err:
        raise RuntimeError(
            f"attention_backend='fla' needs flash-linear-attention ({err}): pip install 'megaflex[gpu]'"
        ) from None
    return chunk_simple_gla


def gla_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    gla_fn: GlaFn | None = None,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """The chunked form's contract computed by a scalar-gated linear-attention kernel ``gla_fn``
    (default: flash-linear-attention's fused ``chunk_simple_gla``; ``chunk_size`` is the kernel's own).
    The decay (``log_decay`` [H]) is folded into kls and the state (``decay.folded``): the gates stay the
    stabiliser's."""
    validate_linear_attention_inputs(
        qf, kf, kls, v, form="chunked", normalization=normalization, chunk_size=chunk_size, initial_state=initial_state,
        eps=eps, log_decay=log_decay,
    )  # fmt: skip
    if log_decay is not None:
        return folded(gla_linear_attention, qf, kf, kls, v, log_decay, normalization=normalization,
                      chunk_size=chunk_size, initial_state=initial_state, eps=eps, gla_fn=gla_fn)  # fmt: skip
    gla = gla_fn if gla_fn is not None else _fla_chunk_simple_gla()
    n, dv = qf.shape[2], v.shape[-1]
    acc = accumulation_dtype(v.dtype)  # gates, state, stabiliser: fp32 (fp64 for fp64 inputs)
    io = v.dtype  # the kernel's operand dtype: it accumulates in fp32 itself
    q, k, lam, vv, state = fp32_inputs(qf, kf, kls, v, initial_state, operand_dtype=io)
    m0 = state.log_max.detach()
    m = torch.maximum(lam.detach().cummax(dim=-1).values, m0.unsqueeze(-1))  # [B, H, N], a constant
    # an empty state (log_max = -inf) holds zeros: start the gates at m_1 so no -inf enters the kernel
    start = torch.where(torch.isfinite(m0), m0, m[..., 0])
    gates = torch.cat([start.unsqueeze(-1), m[..., :-1]], dim=-1) - m  # g_t = m_{t-1} - m_t <= 0
    keys = (k.to(acc) * torch.exp(lam - m).unsqueeze(-1)).to(io)  # exp(kls_s - m_s) kf_s, rounded once
    denominator = reads_denominator(normalization)
    values = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1) if denominator else vv
    s0 = state.augmented() if denominator else state.kv
    s0 = torch.where(torch.isfinite(m0)[..., None, None], s0, torch.zeros_like(s0))

    def seq_major(t: torch.Tensor) -> torch.Tensor:  # [B, H, N, ...] -> [B, N, H, ...]
        return t.transpose(1, 2).contiguous()

    o, final = gla(
        seq_major(q), seq_major(keys), seq_major(values), g=seq_major(gates), scale=1.0,
        initial_state=s0, output_final_state=True,
    )
    o = o.transpose(1, 2).to(acc)  # [B, H, N, Dv(+1)]
    out = normalize_output(o[..., :dv], o[..., dv] if denominator else None, normalization, eps)
    m_last = m[..., -1]
    final = final.to(acc)
    if denominator:
        kv, k_sum = final[..., :dv], final[..., dv]
    else:
        decay = torch.exp(m0 - m_last).nan_to_num(0.0)  # 0 for the empty state
        kv = final
        weights = torch.exp(lam - m_last.unsqueeze(-1))
        k_sum = state.k_sum * decay.unsqueeze(-1) + torch.einsum("bhn,bhnf->bhf", weights, k.to(acc))  # one fp32 sum
    return out.to(v.dtype), LinearAttentionState(kv, k_sum, m_last, state.offset + n)


def fla_linear_attention(
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
    """``gla_linear_attention`` (the same contract, ``log_decay`` included) on fla's ``chunk_simple_gla``; a
    clear RuntimeError without flash-linear-attention or on CPU tensors."""
    gla = _fla_chunk_simple_gla()
    if not qf.is_cuda:
        raise RuntimeError("attention_backend='fla' runs on CUDA tensors only (use 'auto' or 'torch' on CPU)")
    return gla_linear_attention(
        qf, kf, kls, v, normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps, gla_fn=gla,
        log_decay=log_decay,
    )
