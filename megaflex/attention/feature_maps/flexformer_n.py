"""Flexformer-N: two learnable frequency sets and a learnable per-head temperature.

    phi_tilde(x) = exp(||x||^2 / e^tau) * (4D)^-1/2 [cos(O1 x) + cos(O2 x) ; sin(O1 x) + sin(O2 x)]

with ``omega1``, ``omega2``: [H, D, d] and ``tau``: [H]. The kernel is

    phi_tilde(q) . phi_tilde(k) = exp((||q||^2 + ||k||^2) / e^tau) / (4D) * sum_j [cos(O1_j (q - k))
        + cos(O2_j (q - k)) + cos(O1_j q - O2_j k) + cos(O2_j q - O1_j k)].

Design choices:

* Init (``omega_init``). Were O1 and O2 exactly equal they would receive equal gradients and stay
  equal forever (the map is symmetric in O1 <-> O2), collapsing to Flexformer-S. Write s = q.k / sqrt d
  and, at the init tau = log(2 sqrt d), the magnitude exp((||q||^2 + ||k||^2) / (2 sqrt d)); a Gaussian
  argument g has E cos g = exp(-Var g / 2), so each of the four terms has a closed-form expectation:
  - ``"paper"``: O1, O2 ~ N(0, I) * d^-1/4 *independently*. The two "diagonal" terms estimate the
    softmax kernel exp(s); the cross terms cos(O1 q - O2 k) have Var = (||q||^2 + ||k||^2) / sqrt d, which
    the magnitude cancels to 1: E kernel = (exp(s) + 1) / 2. Half of the initial kernel is that uniform
    floor: no key weighs less than half a neutral key's (s = 0), and tau cannot remove it.
  - ``"tied"``: O1 ~ N(0, I) * d^-1/4 and O2 = O1 + eta * N(0, I) * d^-1/4 (eta = ``omega_noise``). Then
    O1 q - O2 k = O1 (q - k) - eta eps k and
        E kernel = (1/4) exp(s) [1 + exp(-eta^2 ||q - k||^2 / (2 sqrt d)) + exp(-eta^2 ||k||^2 / (2 sqrt d))
                                 + exp(-eta^2 ||q||^2 / (2 sqrt d))],
    the softmax kernel times a factor in (0, 1]: no floor for any eta, the extra factors damping keys
    far from q and large norms. eta -> 0 is the softmax estimator but starts O1 ~ O2 (at eta = 0.1 as
    Flexformer-S, the weakest kind of study v4); the arms ``fn_tied_eta*`` try eta = 0.3 - 1.
  - ``"correlated"``: O2 = rho O1 + sqrt(1 - rho^2) eps with eps ~ N(0, I) * d^-1/4 (rho =
    ``omega_correlation`` in (0, 1)): both sets keep the marginal N(0, I) * d^-1/4, so both diagonal
    terms estimate exp(s) exactly, and the cross terms have Var = (||q||^2 + ||k||^2 - 2 rho q.k) / sqrt d:
        E kernel = (exp(s) + exp(rho s)) / 2,
    the mean of the softmax kernel and a softer one (temperature sqrt d / rho): no floor (it falls to 0
    as s -> -inf for every rho > 0), no norm-dependent damping, and the pairs differ by as much as
    rho allows (the tied init at eta has correlation 1 / sqrt(1 + eta^2)). rho -> 0 is the paper's init.
  All three draw the same random values (O1's, then O2's, reused as the noise), so the rest of the
  model's init is unchanged. Default ``"paper"`` (the recipe changes only after the issue-46 study):
  in the single-seed pilot (docs/results/kernel_pilot) ``"tied"`` at eta = 0.1 was better on
  english-docs valid but worse on WikiText-2 test. To change the default, set it in
  ``ModelConfig.feature_kwargs``' default, not here: a checkpoint records the feature_kwargs it was
  trained with, and an empty mapping must keep meaning these constructor defaults.
* tau init log(2 sqrt d): the softmax temperature.
* Temperature floor: a learnable tau could run to -inf (e^tau -> 0 makes ||x||^2 / e^tau explode and
  the kernel a near-delta on the largest key). The effective temperature is
  ``tau_eff = floor + softplus_beta(tau - floor)`` with beta = 10, taken as exactly ``tau`` once
  tau > floor + 2 (where the two differ by < 1e-9) and smoothly saturating at ``floor`` below,
  with a non-zero gradient so tau can recover. The floor defaults
  to ``log(2 sqrt d) - 3`` (temperature may shrink ~20x below the softmax one), and can be set
  with ``min_log_temperature``.
* Temperature ceiling (``max_log_temperature``, default None: none; issue 46). A larger tau softens
  the kernel toward uniform weights: the magnitude exp(||x||^2 / e^tau) stops cancelling the decay
  of the cos terms, and every key's weight moves toward the same value. tau has no weight decay and
  rides on the kernel LR group (x10 by default), and it drifts up with training length (2.43 at
  init, 2.68 after 300 steps, 3.28 after 600 at the cpu4x size): over a 100k-step schedule nothing
  bounds it. The ceiling is the floor's mirror, applied after it:
  ``tau_eff = ceiling - softplus_gamma(ceiling - tau')``, exactly ``tau'`` once tau' < ceiling - 0.4
  (gamma = 50: the two differ by < 1e-10 there) and saturating at the ceiling above, with a gradient
  sigmoid(gamma (ceiling - tau')) that is ~1 below the ceiling and never 0, so tau can come back
  down. It is sharper than the floor because it is meant to sit close to the init (the drift it
  bounds is 0.3-0.9): with beta = 10 the identity region would end 2 below it, above the init only
  for a ceiling >= log(2 sqrt d) + 2, which bounds nothing that matters. A reparametrisation
  (e.g. tau = lo + (hi - lo) sigmoid(u)) would bound it too, but changes tau's meaning, its Adam
  step scale and every checkpoint's parameter; the ceiling keeps all three and is the identity
  wherever it does not act. It must lie at least 2.4 above the floor (the two soft regions apart).
  Set it in absolute units (log(2 sqrt d) = 2.43 at d = 32, 2.77 at d = 64), like the floor.
* Fused (``trig.py``): one projection onto the stacked [O1 ; O2], cos/sin once, the pair sums,
  scale and log-scale in one autograd.Function with a hand-written, cache-blocked backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import FeatureMap, FeatureMapOutput, KernelParameter
from .common import check_even_feature_dim, fp32_region, log_sqrt_scale, quarter_root, upcast
from .trig import trig_feature_map

OMEGA_INITS = ("paper", "tied", "correlated")
# softplus sharpness for the tau floor; identity above floor + _THRESHOLD / _BETA = floor + 2
_BETA = 10.0
_THRESHOLD = 20.0
# ... and for the ceiling: identity below ceiling - _THRESHOLD / _CEILING_BETA = ceiling - 0.4
_CEILING_BETA = 50.0
DEFAULT_FLOOR_MARGIN = 3.0  # default floor = log(2 sqrt d) - this


class FlexformerNFeatureMap(FeatureMap):
    """Learnable two-frequency-set random-Fourier map with learnable temperature e^tau."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_dim: int,
        *,
        min_log_temperature: float | None = None,
        max_log_temperature: float | None = None,
        omega_init: str = "paper",
        omega_noise: float = 0.1,
        omega_correlation: float = 0.5,
    ) -> None:
        super().__init__()
        if omega_init not in OMEGA_INITS:
            raise ValueError(f"omega_init: expected one of {OMEGA_INITS}, got {omega_init!r}")
        if not omega_noise > 0:
            raise ValueError(f"omega_noise: expected > 0 (0 would tie O1 and O2 forever), got {omega_noise!r}")
        if not 0 < omega_correlation < 1:
            raise ValueError(f"omega_correlation: expected in (0, 1) (1 ties O1 and O2 forever, 0 is omega_init "
                             f"'paper'), got {omega_correlation!r}")
        self.omega_init, self.omega_noise, self.omega_correlation = omega_init, float(omega_noise), float(omega_correlation)
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.num_frequencies = check_even_feature_dim("flexformer_n", feature_dim)
        if min_log_temperature is None:
            min_log_temperature = log_sqrt_scale(head_dim) - DEFAULT_FLOOR_MARGIN
        self.min_log_temperature = float(min_log_temperature)
        if max_log_temperature is not None:
            gap = _THRESHOLD / _BETA + _THRESHOLD / _CEILING_BETA
            if isinstance(max_log_temperature, bool) or not isinstance(max_log_temperature, (int, float)) \
                    or not math.isfinite(max_log_temperature) or max_log_temperature < self.min_log_temperature + gap:
                raise ValueError(f"max_log_temperature: expected a number >= min_log_temperature + {gap:g} = "
                                 f"{self.min_log_temperature + gap:.4g} (or null: no ceiling), got {max_log_temperature!r}")
            max_log_temperature = float(max_log_temperature)
        self.max_log_temperature = max_log_temperature
        self.omega1 = nn.Parameter(torch.empty(num_heads, self.num_frequencies, head_dim))
        self.omega2 = nn.Parameter(torch.empty(num_heads, self.num_frequencies, head_dim))
        self.tau = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = quarter_root(self.head_dim)
        nn.init.normal_(self.omega1, std=std)
        nn.init.normal_(self.omega2, std=std)
        with torch.no_grad():  # the O2 draw above is reused as the noise
            if self.omega_init == "tied":  # O2 = O1 + eta * noise
                self.omega2.mul_(self.omega_noise).add_(self.omega1)
            elif self.omega_init == "correlated":  # O2 = rho O1 + sqrt(1 - rho^2) noise: the same marginal
                rho = self.omega_correlation
                self.omega2.mul_(math.sqrt(1.0 - rho * rho)).add_(self.omega1, alpha=rho)
        nn.init.constant_(self.tau, log_sqrt_scale(self.head_dim))

    def kernel_parameters(self) -> list[KernelParameter]:
        return [
            KernelParameter("omega1", self.omega1, "frequencies"),
            KernelParameter("omega2", self.omega2, "frequencies"),
            KernelParameter("tau", self.tau, "temperature"),
        ]

    def log_temperature(self) -> torch.Tensor:
        """Effective tau [H] after the soft floor and the optional soft ceiling (equals ``tau`` whenever
        floor + 2 < tau < ceiling - 0.4)."""
        floor, tau = self.min_log_temperature, upcast(self.tau)
        soft = floor + F.softplus(tau - floor, beta=_BETA)
        # select tau itself above floor + 2 so the effective value is bit-exact there
        tau = torch.where(tau > floor + _THRESHOLD / _BETA, tau, soft)
        ceiling = self.max_log_temperature
        if ceiling is None:
            return tau
        soft = ceiling - F.softplus(ceiling - tau, beta=_CEILING_BETA)
        return torch.where(tau < ceiling - _THRESHOLD / _CEILING_BETA, tau, soft)

    def trig_spec(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(omega [H, 2D, d] = [O1 ; O2], inv_temperature [H], paired=True), differentiable in the
        parameters: the map is ``trig_feature_map(x, *spec)`` (the Triton path fuses it)."""
        with fp32_region(self.omega1):
            return torch.cat([self.omega1, self.omega2], dim=1), torch.exp(-self.log_temperature()), True

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        omega, inv_temperature, paired = self.trig_spec()
        with fp32_region(x):
            features, log_scale = trig_feature_map(x, omega, inv_temperature, paired=paired)
        return FeatureMapOutput(features, log_scale)  # [B, H, N, 2D] in x.dtype, [B, H, N] fp32

    def extra_repr(self) -> str:
        ceiling = "" if self.max_log_temperature is None else f", max_log_temperature={self.max_log_temperature:g}"
        return f"{super().extra_repr()}, omega_init={self.omega_init}{ceiling}"
