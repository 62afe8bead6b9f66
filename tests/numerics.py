"""Rounding-error bounds for the suite's numerical comparisons (not a test module).

A tolerance that encodes one CPU's rounding fails on another: OpenBLAS (numpy, hence Triton's
interpreter) and ATen pick different kernels per CPU family, which sum in different orders and
fuse multiply-adds differently. So every comparison of two computations of the same quantity is
bounded by what floating point allows for *any* summation order, not by what one machine gave:

    |computed - exact| <= steps * u * scale           (first-order forward-error bound)

* ``u``: the unit roundoff of the precision the computation runs in (fp32: 2^-24);
* ``steps``: the relative-error growth of the computation, the sum of its parts: a length-n sum or
  dot product contributes n (Higham's gamma_n ~ n u, which holds for every summation order), an
  exp(x) contributes |x| (its argument carries |x| u absolute error, e.g. the key log-scale
  spread in linear attention), each further elementwise operation 1;
* ``scale``: the magnitude the error is relative to, max |exact| (normwise), floored where a
  quantity can be 0 in exact arithmetic while its terms are not (e.g. gradients of a normalised
  output), since the rounding error then scales with the terms, not with the result.

Two fp32 computations of the same quantity (two forms, segments vs one shot, TP vs single rank)
each lie within the bound of the exact value, so they differ by at most twice it
(``assert_close``).

A normwise bound cannot see an ill-conditioned result: under rms or denominator normalisation a
sum of signed terms can cancel, and its rounding error is then relative to the terms, not to the
result. Where that happens (kernels with signed features, key scales x100) the kernel is checked
against an fp64 reference with the conditioning measured rather than guessed
(``assert_close_to_reference``): the error of a plain same-precision reference form (torch's
quadratic form, no OpenBLAS involved) vs fp64 carries it, and the kernel may exceed the normwise
bound by at most ``CONDITIONING_FACTOR`` times that error.

After optimizer steps the two computations are no longer within rounding of each other: Adam's
step is about lr * sign(g) for every |g| >> eps, so an element whose gradient is within rounding of
0 steps +lr in one run and -lr in the other, whichever way the CPU's reduction order rounded it.
Parameters after Adam are bounded by what an update can move an element
(``assert_params_close_after_adam``); quantities only rounding changes (a step's loss, the gradient
norm of the first step) keep the rounding bounds (``training_loss_steps``, ``grad_norm_steps``).

Bit-exact claims (resume, determinism on one machine) use ``torch.equal``, not this module.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


CONDITIONING_FACTOR = 10.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def error_bound(steps: float, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """``steps * u(dtype) * scale``: the largest forward error of a computation whose relative
    error grows by ``steps`` unit roundoffs (see the module docstring for how to count them)."""
    return steps * unit_roundoff(dtype) * scale


def normwise_scale(exact: torch.Tensor, floor: float = 0.0) -> float:
    """max |exact|, at least ``floor``."""
    return max(exact.detach().double().abs().max().item() if exact.numel() else 0.0, floor)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.detach().double() - want.detach().double()).abs().max().item() if got.numel() else 0.0


def fp32_steps_in(dtype: torch.dtype, steps: float) -> float:
    """``steps`` of fp32 rounding expressed in unit roundoffs of ``dtype`` (fp32 accumulation
    inside a lower-precision computation)."""
    return steps * unit_roundoff(torch.float32) / unit_roundoff(dtype)


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    steps: float,
    dtype: torch.dtype = torch.float32,
    floor: float = 0.0,
    plain: torch.Tensor | None = None,
    name: str = "",
) -> None:
    """``got`` and ``want`` compute the same quantity in ``dtype`` with error growth ``steps``:
    each within ``error_bound`` of the exact value, so they differ by at most twice it. The scale
    is max |want|, at least ``floor``. ``plain``: a third computation of it in another form, for
    ill-conditioned problems without a more precise reference (fp64 inputs): the bound grows by
    ``CONDITIONING_FACTOR`` x max |plain - want| (the conditioning, measured)."""
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"{name}: non-finite values"
    bound = 2 * error_bound(steps, normwise_scale(want, floor), dtype)
    if plain is not None:
        bound += CONDITIONING_FACTOR * max_error(plain, want)
    err = max_error(got, want)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (2 x {steps:g} x u x scale + conditioning)"



def assert_close_to_reference(
    got: torch.Tensor,
    plain: torch.Tensor,
    exact: torch.Tensor,
    *,
    steps: float,
    dtype: torch.dtype = torch.float32,
    floor: float = 0.0,
    name: str = "",
) -> None:
    """``got`` (the computation under test) vs ``exact`` (fp64): within the normwise bound plus
    ``CONDITIONING_FACTOR`` x the error of ``plain`` (a same-precision reference form) vs ``exact``,
    which measures how far the problem's conditioning amplifies rounding. Scale: max |exact|, at
    least ``floor``."""
    assert exact.dtype == torch.float64, f"{name}: the reference must be fp64, got {exact.dtype}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    bound = error_bound(steps, normwise_scale(exact, floor), dtype)
    conditioning = CONDITIONING_FACTOR * max_error(plain, exact)
    err = max_error(got, exact)
    assert err <= bound + conditioning, (
        f"{name}: max error vs fp64 {err:.3e} > bound {bound:.3e} ({steps:g} x u x scale)"
        f" + {CONDITIONING_FACTOR:g} x the plain form's error ({conditioning:.3e})"
    )


def gpt_steps(config: Any, seq_len: int, backward: bool = False) -> float:
    """Error growth of a megaflex GPT forward (``backward``: and its backward) on ``seq_len`` tokens:
    per layer the hidden-size sums of the q/k/v and output projections and the norms, the MLP's
    ffn-size sum, attention over the tokens, features and head dimension (x2 for its map and log-
    scales), plus the hidden-size sum of the logits; a handful of elementwise steps each."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_heads
    ffn = config.ffn_hidden_size or 4 * hidden
    attention = 2 * (seq_len + 1 + config.feature_dim + 2 * head_dim + config.softmax_window + config.qkv_conv_size)
    per_layer = 4 * hidden + ffn + attention + 8
    forward = config.num_layers * per_layer + hidden + 8
    return 2 * forward if backward else forward


def training_loss_steps(config: Any, seq_len: int, tokens: int, ranks: int = 1) -> float:
    """Error growth of a training step's logged loss: the forward on ``seq_len`` tokens, the
    cross-entropy's vocabulary-term log-sum-exp, the mean over the step's ``tokens`` (micro-batches
    and ranks summed in any order) and the all-reduces over ``ranks``.

    Later steps' losses, after Adam's updates, are held to it too: the elements Adam moves apart
    in two runs are those whose gradient is within rounding of 0, so to first order each moves
    the loss by that rounding-sized gradient times <= 2 lr per step. Not a worst case (every
    element flipping would exceed it), but a loss off by more than its rounding is not that."""
    return gpt_steps(config, seq_len) + config.vocab_size + tokens + ranks + 4


def training_grad_steps(config: Any, seq_len: int, tokens: int, ranks: int = 1) -> float:
    """Error growth of a training step's gradients (on the scale the caller gives: the largest
    gradient's, or each tensor's own): the backward, whose every gradient sums over the step's
    ``tokens``, the loss's vocabulary sums and the all-reduces over ``ranks``."""
    return gpt_steps(config, seq_len, backward=True) + 2 * (tokens + config.vocab_size + ranks)


def grad_norm_steps(config: Any, seq_len: int, tokens: int, numel: int, ranks: int = 1) -> float:
    """Error growth of the global gradient norm of a training step, relative to the norm: the
    gradients' (``training_grad_steps``), taken normwise (relative to their 2-norm: a run's log has
    no per-tensor scales for ``norm_steps``), the sum of ``numel`` squares and its square root."""
    return training_grad_steps(config, seq_len, tokens, ranks) + numel / 2 + 2


def norm_steps(steps: float, values: Sequence[torch.Tensor], norm: float, floor: float = 0.0) -> float:
    """Error growth, relative to ``norm``, of the 2-norm of the tensors ``values`` whose elements are
    each within ``error_bound(steps, scale)`` of exact, ``scale`` the tensor's ``normwise_scale``
    (at least ``floor``): sqrt(sum of numel x scale^2) of those in the 2-norm, plus the sum of
    squares (numel terms) and the square root."""
    spread = math.sqrt(sum(v.numel() * normwise_scale(v, floor) ** 2 for v in values))
    return steps * spread / norm + sum(v.numel() for v in values) / 2 + 2


def adam_update_bound(step: int, betas: tuple[float, float]) -> float:
    """The largest |m_hat / sqrt(v_hat)| of Adam's step ``step`` (1-based) over *every* gradient
    history: by Cauchy-Schwarz on m_t = (1-b1) sum_i b1^(t-i) g_i against v_t = (1-b2) sum_i
    b2^(t-i) g_i^2, |m_t| <= (1-b1) sqrt(sum_k<t (b1^2/b2)^k) sqrt(v_t / (1-b2)), and the bias
    corrections divide by 1-b1^t and 1-b2^t. 1 at step 1, ~1.00 for the first steps at (0.9, 0.95)."""
    b1, b2 = betas
    ratio = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) / (1 - b1**step) * math.sqrt((1 - b2**step) / (1 - b2) * ratio)


def adam_drift_bound(lrs: Sequence[float], betas: tuple[float, float]) -> float:
    """How far apart two AdamW runs from the same weights can end, per element, whatever their
    gradients: step t moves an element by at most lr_t x ``adam_update_bound(t)`` (eps only shrinks
    it) in each run, so they part by at most twice that; the decoupled weight decay w (1 - lr wd)
    only shrinks a difference."""
    return 2 * sum(lr * adam_update_bound(t, betas) for t, lr in enumerate(lrs, start=1))


def first_adam_step_bound(grad: torch.Tensor, grad_error: float, lr: float, eps: float) -> torch.Tensor:
    """Per element, how far Adam's first step (lr g / (|g| + eps)) can part two runs whose gradients
    differ by at most ``grad_error`` (``grad``: one run's): where |g| > grad_error both have its
    sign, and the steps differ by lr eps ||g| - |g'|| / ((|g| + eps)(|g'| + eps)); elsewhere the
    step can go either way: 2 lr."""
    g = grad.double().abs()
    same_sign = lr * eps * grad_error / ((g + eps) * (g - grad_error + eps)).clamp_min(eps * eps)
    return torch.where(g > grad_error, same_sign.clamp_max(2 * lr), torch.full_like(g, 2 * lr))


def assert_params_close_after_adam(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    lrs: Sequence[float],
    betas: tuple[float, float],
    lr_multiplier: Callable[[str], float] = lambda name: 1.0,
    first_step: tuple[Mapping[str, torch.Tensor], float, float] | None = None,
    name: str = "",
) -> float:
    """Parameters of two AdamW runs from the same weights whose gradients differ by rounding, after
    ``len(lrs)`` steps of learning rates ``lrs`` (``lr_multiplier(name)``: a parameter group's
    multiplier): per element within ``adam_drift_bound`` (an element whose gradient is within
    rounding of 0 can step either way at every step) plus the rounding of the updates themselves
    (a few operations per step on |w| and on the step, in each run).

    After one step, ``first_step`` = (one run's gradients by name, their error growth ``steps``,
    Adam's eps) makes it tight where the gradient is well away from 0 (``first_adam_step_bound``;
    the two runs' gradients differ by at most twice ``error_bound(steps)`` on each tensor's own
    scale: a parameter's gradient sums its own terms, the feature maps' ~1e-5 against the
    embedding's ~1e-2). Later gradients depend on the weights the steps moved, which no rounding
    bound covers, so only the first step has that. Returns the drift bound of multiplier 1, for
    the caller to show it is below what a misplaced tensor would differ by."""
    assert actual.keys() == expected.keys(), f"{name}: {sorted(actual.keys() ^ expected.keys())}"
    assert first_step is None or len(lrs) == 1, "first_step: one step only"
    drift = adam_drift_bound(lrs, betas)
    for key, want in expected.items():
        got, lr_scale = actual[key], lr_multiplier(key)
        assert got.shape == want.shape and torch.isfinite(got).all(), f"{name} {key}: shape or non-finite"
        err = (got.double() - want.double()).abs()
        moved = torch.full_like(err, drift * lr_scale)
        if first_step is not None:
            grads, grad_steps, eps = first_step
            grad_error = 2 * error_bound(grad_steps, normwise_scale(grads[key]))
            moved = first_adam_step_bound(grads[key], grad_error, lrs[0] * lr_scale, eps)
        bound = moved + 2 * error_bound(4 * len(lrs), 1.0) * (want.double().abs() + sum(lrs) * lr_scale)
        worst = int((err - bound).argmax())
        assert (err <= bound).all(), (
            f"{name} {key}: element {worst} off by {err.flatten()[worst].item():.3e} > its bound"
            f" {bound.flatten()[worst].item():.3e} (Adam's steps {moved.flatten()[worst].item():.3e} + their rounding)"
        )
    return drift


def linear_cross_entropy_steps(
    hidden: int, vocab: int, tokens: int, max_logit: float, chunks: int = 1, dtype: torch.dtype = torch.float32
) -> float:
    """Error growth, in unit roundoffs of ``dtype``, of the per-token cross-entropy of the logits
    hidden_states @ W.T ([tokens, vocab], ``dtype`` with fp32 accumulation, the loss in fp32) and of its
    gradients wrt the hidden states and W, on the scale of the largest of the logits, the loss and the
    gradient: the logits' ``hidden``-term sums, rounded to ``dtype`` once, move the loss by at most
    twice their error; the loss's vocabulary sum of exps (arguments down to -2 max |logit|), its log and
    division; the gradient's rounding to ``dtype``, the hidden states' vocabulary-term and W's
    token-term sums, W's in ``chunks`` partial sums each rounded to ``dtype`` before they are added."""

    def in_dtype(steps: float) -> float:  # fp32 arithmetic inside a ``dtype`` computation
        return steps if dtype == torch.float32 else fp32_steps_in(dtype, steps)

    logits = 1 + in_dtype(hidden)
    loss = 2 * logits + in_dtype(vocab + 2 * max_logit + 8)
    return loss + 1 + chunks + in_dtype(vocab + tokens)
