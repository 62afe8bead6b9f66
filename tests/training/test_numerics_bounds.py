"""The optimizer bounds of tests/numerics.py hold for torch's AdamW, and are attained."""

from __future__ import annotations

import pytest
import torch

from numerics import adam_drift_bound, adam_update_bound, error_bound, first_adam_step_bound

BETAS = (0.9, 0.95)


def _adam_steps(grads: torch.Tensor, lrs: list[float], eps: float = 1e-30) -> torch.Tensor:
    """Each step's update of AdamW (no decay) on parameters with the gradient rows ``grads``."""
    p = torch.zeros(grads.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=BETAS, eps=eps, weight_decay=0.0)
    updates = []
    for g, lr in zip(grads, lrs):
        before = p.detach().clone()
        opt.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        opt.step()
        updates.append(p.detach() - before)
    return torch.stack(updates)


@pytest.mark.parametrize("steps", [1, 2, 5, 30])
def test_adam_update_bound_holds_for_any_history_and_is_attained(steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    # random histories with magnitudes over 12 decades, signs flipping
    magnitudes = 10 ** (12 * torch.rand(steps, 4096, generator=gen, dtype=torch.float64) - 8)
    grads = torch.randn(steps, 4096, generator=gen, dtype=torch.float64) * magnitudes
    # the Cauchy-Schwarz equality case: g_i proportional to (b1/b2)^(t-i)
    worst = torch.tensor([(BETAS[0] / BETAS[1]) ** (steps - i) for i in range(1, steps + 1)], dtype=torch.float64)
    grads[:, 0] = worst
    updates = _adam_steps(grads, [1.0] * steps)
    bounds = torch.tensor([adam_update_bound(t, BETAS) for t in range(1, steps + 1)], dtype=torch.float64)
    assert (updates.abs() <= bounds[:, None] * (1 + 1e-12)).all()
    assert updates[-1, 0].abs().item() == pytest.approx(bounds[-1].item(), rel=1e-12)  # attained: no looser than need be


def test_adam_drift_bound_covers_two_runs_that_differ_by_rounding_near_zero() -> None:
    # gradients within +-1e-12 of 0 in both runs, opposite signs: each step parts them by 2 lr
    lrs = [1e-3, 2e-3, 3e-3, 1.5e-3]
    a = torch.full((4, 1), 1e-12, dtype=torch.float64)
    drift = (_adam_steps(a, lrs).sum(0) - _adam_steps(-a, lrs).sum(0)).abs().item()
    assert drift <= adam_drift_bound(lrs, BETAS) * (1 + 1e-12)
    assert drift == pytest.approx(adam_drift_bound(lrs, BETAS), rel=1e-2)


def test_first_adam_step_bound_covers_gradients_within_the_error_and_is_tight_away_from_0() -> None:
    gen = torch.Generator().manual_seed(0)
    lr, eps, error = 1e-3, 1e-8, 1e-6
    magnitudes = 10 ** (-8 * torch.rand(1, 100_000, generator=gen, dtype=torch.float64))
    grads = torch.randn(1, 100_000, generator=gen, dtype=torch.float64) * magnitudes
    other = grads + error * (2 * torch.rand(grads.shape, generator=gen, dtype=torch.float64) - 1)  # within the error
    apart = (_adam_steps(grads, [lr], eps) - _adam_steps(other, [lr], eps)).abs()[0]
    bound = first_adam_step_bound(grads[0], error, lr, eps)
    assert (apart <= bound + 2 * error_bound(4, lr, torch.float64)).all()  # + the steps' own (fp64) rounding
    near_zero = grads[0].abs() <= error
    assert near_zero.any() and (bound[near_zero] == 2 * lr).all() and apart[near_zero].max() > lr  # they do flip
    assert bound[grads[0].abs() > 100 * error].max() < 1e-3 * lr  # elsewhere the step is the same to 1e-3 lr
