"""The output normalisations of linear attention, in one place: the forward (``normalize_output``),
its backward on saved numerators (``normalize_backward``; both in one autograd function:
``normalize_numerators``), the cap, which ones read the kernel sum
(``reads_denominator``) and the Triton kernels' flags (``kernel_flags``).

Output normalisation (shared by every form, so they agree to rounding):

* ``"rms"`` (default): ``o_t = n_t * rsqrt(mean_j n_tj^2 + eps)``. Parameter-free per-head RMS
  norm of the numerator ``n_t = sum_s w_ts v_s``; the model adds a learnable gain. It never
  divides by the kernel sum, which for trig (random-Fourier) features is a signed Monte-Carlo
  estimate that can cross zero, so it is the stable default. Like the classic denominator it is
  invariant to per-query scalars (which is why the query log-scale can be dropped).
* ``"denominator"``: ``o_t = n_t / guard(d_t)`` with ``d_t = sum_s w_ts`` and
  ``guard(x) = sign(x) * max(|x|, eps)``, ``sign(0) = +1``: the classic linear-attention
  normalisation, guarded so a denominator crossing zero gives a large but finite output.
  Exact for positive feature maps; needed to compare against softmax attention. With signed
  (trig) features it does not train: the first negative weights drive some d_t to ~0 and the
  gradient norm to 1e4+ (docs/results/kernel_study_v3/denominator.md).
* ``"capped_denominator"``: ``o_t = n_t / max(d_t, r_t / OUTPUT_RMS_CAP)`` with
  ``r_t = sqrt(mean_j n_tj^2 + eps^2)``: the denominator's ratio wherever it keeps the output's
  RMS at most ``OUTPUT_RMS_CAP``, the RMS norm scaled to that ceiling where d_t is small, negative
  or zero. Equal to ``"denominator"`` for every query whose output is not larger than the cap
  (softmax-like weights give a convex combination of the values, whose RMS is O(1) at the
  model's scale), bounded outputs and gradients everywhere; invariant to per-query scalars up to eps.
"""

from __future__ import annotations

import torch

NORMALIZATIONS = ("rms", "denominator", "capped_denominator")
# "capped_denominator": the largest output RMS the denominator's ratio may give before the RMS norm
# takes over. The model's values are O(0.1-1) per entry (RMS-normed inputs, 0.02-std projections),
# so the ceiling only binds near-zero or negative denominators; 2 and 8 both train (one seed).
OUTPUT_RMS_CAP = 2.0


def reads_denominator(normalization: str) -> bool:
    """Whether ``normalization`` divides by the kernel sum d_t (the forms then carry it)."""
    return not is_rms_norm(normalization)


def guard_denominator(x: torch.Tensor, eps: float) -> torch.Tensor:
    """sign(x) * max(|x|, eps) with sign(0) = +1: keeps the magnitude of a denominator >= eps."""
    return torch.where(x >= 0, x.clamp(min=eps), x.clamp(max=-eps))


def output_rms(numerator: torch.Tensor, eps: float) -> torch.Tensor:
    """r = sqrt(mean n^2 + eps^2) [...] of ``numerator`` [..., Dv]: the RMS "capped_denominator" caps."""
    return torch.sqrt(numerator.pow(2).mean(dim=-1) + eps * eps)


def capped_denominator(numerator: torch.Tensor, denominator: torch.Tensor, eps: float, rms: torch.Tensor | None = None) -> torch.Tensor:
    """max(d, r / OUTPUT_RMS_CAP) [...] of ``numerator`` [..., Dv], ``denominator`` [...]; ``rms``: r if
    the caller has it (``output_rms``)."""
    return torch.maximum(denominator, (output_rms(numerator, eps) if rms is None else rms) / OUTPUT_RMS_CAP)


def check_normalization(normalization: str) -> None:
    """ValueError unless ``normalization`` is one of ``NORMALIZATIONS``."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")


def is_rms_norm(normalization: str) -> bool:
    """Whether the output is the parameter-free RMS norm of the numerator (unit RMS per head: the
    model adds a learnable gain, and the hybrid's window output is normed the same way)."""
    return normalization == "rms"


def kernel_flags(normalization: str) -> dict[str, bool | float]:
    """The Triton kernels' constexprs for ``normalization`` (``triton/linear_kernels.chunk_outputs``):
    RMS (the RMS norm) and CAP (the output RMS ceiling of "capped_denominator", 0 for the others)."""
    return dict(RMS=is_rms_norm(normalization), CAP=OUTPUT_RMS_CAP if normalization == "capped_denominator" else 0.0)


def normalize_output(numerator: torch.Tensor, denominator: torch.Tensor | None, normalization: str, eps: float) -> torch.Tensor:
    """Apply the output normalisation to fp32 ``numerator`` [..., Dv] (``denominator`` [...]).

    ``denominator`` is only read when ``reads_denominator(normalization)`` (may be None for "rms").
    """
    if is_rms_norm(normalization):
        return numerator * torch.rsqrt(numerator.pow(2).mean(dim=-1, keepdim=True) + eps)
    if normalization in NORMALIZATIONS:
        if denominator is None:
            raise ValueError(f"normalize_output: normalization={normalization!r} needs a denominator, got None")
        if normalization == "capped_denominator":
            return numerator / capped_denominator(numerator, denominator, eps).unsqueeze(-1)
        return numerator / guard_denominator(denominator, eps).unsqueeze(-1)
    raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")


def normalize_backward(n: torch.Tensor, grad: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """Gradient w.r.t. the saved fp32 numerators of ``normalize_output``: n [..., Dv] for "rms", or
    n_aug = [numerator, denominator] [..., Dv+1] for the ones that read the denominator."""
    grad = grad.to(n.dtype)
    if is_rms_norm(normalization):  # o = n r, r = (mean n^2 + eps)^-1/2: dn = r g - r^3 mean(n g) n
        r = torch.rsqrt(n.pow(2).mean(dim=-1, keepdim=True) + eps)
        coef = (n * grad).mean(dim=-1, keepdim=True) * r.pow(3)
        return (grad * r).sub_(n * coef)
    # o = n / G(d): dn = g / G, dd = -(g . o) / G where the guard is inactive (|d| >= eps)
    dv = n.shape[-1] - 1
    num, den = n[..., :dv], n[..., dv]
    d_n = torch.empty_like(n)
    if normalization == "capped_denominator":
        # G = max(d, r / cap), r = (mean n^2 + eps^2)^1/2. Where d wins, as above; where the floor
        # wins, o = cap n / r (the RMS norm): dn = g / G - cap mean(n g) / r^3 n, dd = 0
        r = output_rms(num, eps)
        guard = capped_denominator(num, den, eps, r)
        ratio = den >= guard
        torch.div(grad, guard.unsqueeze(-1), out=d_n[..., :dv])
        ng = (num * grad).mean(dim=-1)
        coef = torch.where(ratio, 0.0, ng * OUTPUT_RMS_CAP / r.pow(3))
        d_n[..., :dv] -= coef.unsqueeze(-1) * num
        d_n[..., dv] = torch.where(ratio, -dv * ng / guard.pow(2), 0.0)
        return d_n
    guard = guard_denominator(den, eps)
    torch.div(grad, guard.unsqueeze(-1), out=d_n[..., :dv])
    d_n[..., dv] = -(d_n[..., :dv] * num).sum(dim=-1) / guard * (den.abs() >= eps)
    return d_n


class _Normalize(torch.autograd.Function):
    """``normalize_output`` of numerators [..., Dv] ("rms") or [..., Dv + 1] (numerator, denominator)
    with ``normalize_backward``: a few passes instead of autograd's ~8 ops and their
    temporaries (the plain kernel fuses the same pair)."""

    @staticmethod
    def forward(ctx, numer, normalization, eps):  # type: ignore[override]
        dv = numer.shape[-1] - reads_denominator(normalization)
        ctx.save_for_backward(numer)
        ctx.meta = (normalization, eps)
        return normalize_output(numer[..., :dv], numer[..., dv] if reads_denominator(normalization) else None, normalization, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (numer,) = ctx.saved_tensors
        return normalize_backward(numer, grad, *ctx.meta), None, None


def normalize_numerators(numer: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """The output of ``ChunkedWindowNumerator``'s numerators [..., Dv'] (Dv' = Dv for "rms", Dv + 1 for
    "denominator"): ``normalize_output`` with a hand-written backward."""
    return _Normalize.apply(numer, normalization, eps)
