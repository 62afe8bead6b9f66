"""Optimizer pieces: weight-decay and kernel LR groups, a skippable torch AdamW and the LR schedule.

Groups (``param_groups``):

* ``decay``: matrices and embeddings (as in Megatron-LM);
* ``no_decay``: parameters with fewer than 2 dims (biases, norm gains), names matching
  ``optimizer.no_decay_patterns``, and every learnable kernel parameter whose LR multiplier is 1;
* ``kernel_frequencies`` / ``kernel_temperature``: the feature maps' Omega and tau
  (``megaflex.attention.named_kernel_parameters``: the maps declare them), no weight decay, LR =
  scheduled LR x ``optimizer.kernel_{frequency,temperature}_lr_multiplier``; a group exists only
  when its multiplier is not 1, so runs and checkpoints with multipliers 1 have the plain two groups.

``optimizer.freeze_kernel`` freezes every declared kernel parameter instead (``freeze_kernel_parameters``:
requires_grad off, so it is in no group and gets no gradient): the only way to hold a map weight
such as hedgehog's W fixed, which has no multiplier of its own.

Kernel parameters never decay: decay pulls Omega to 0 (a flat kernel), tau towards a fixed
temperature and hedgehog's W towards uniform features; none of that regularises capacity.

Why the multipliers: Adam's step is ~lr per element whatever the parameter's scale. Omega's
elements are ~d^-1/4 (0.42 at d = 32) and tau ~2.4, against ~0.02 for the matrices, so at one
LR the kernel moves 15-80x slower relative to its size. Under Adam, learning Omega = s * Omega_hat
with Omega_hat in unit scale is exactly an LR multiplier s on Omega (gradient scale cancels), so
the multiplier *is* that reparametrisation, without renaming parameters (checkpoints keep loading).

The LR schedule is a pure function of the iteration (``lr_at``): the trainer writes it into the
optimizer's param groups before each step (``set_lr`` applies each group's ``lr_multiplier``), so
resuming needs no scheduler state.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from megaflex.attention import named_kernel_parameters
from megaflex.parallel import comm
from megaflex.parallel.deferred_init import full_shape
from megaflex.training.config import Config

KERNEL_GROUPS = {"frequencies": "kernel_frequencies", "temperature": "kernel_temperature"}


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay_patterns: Iterable[str] = (),
    lr_multipliers: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """AdamW groups ``decay``, ``no_decay`` and the kernel groups (empty groups are dropped).

    ``lr_multipliers`` maps a kernel role ("frequencies", "temperature") to its LR multiplier.
    """
    patterns = [p.lower() for p in no_decay_patterns]
    multipliers = {role: float((lr_multipliers or {}).get(role, 1.0)) for role in KERNEL_GROUPS}
    kernel_role = {id(kp.param): kp.role for _, kp in named_kernel_parameters(model)}
    buckets: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], **{g: [] for g in KERNEL_GROUPS.values()}}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        role = kernel_role.get(id(param))
        if role in KERNEL_GROUPS and multipliers[role] != 1.0:
            buckets[KERNEL_GROUPS[role]].append(param)
        elif role is not None or len(full_shape(param)) < 2 or any(p in name.lower() for p in patterns):
            buckets["no_decay"].append(param)
        else:
            buckets["decay"].append(param)
    groups = [
        {"params": buckets["decay"], "weight_decay": weight_decay, "name": "decay", "lr_multiplier": 1.0},
        {"params": buckets["no_decay"], "weight_decay": 0.0, "name": "no_decay", "lr_multiplier": 1.0},
    ]
    for role, group in KERNEL_GROUPS.items():
        groups.append({"params": buckets[group], "weight_decay": 0.0, "name": group, "lr_multiplier": multipliers[role]})
    return [g for g in groups if g["params"]]


def freeze_kernel_parameters(model: nn.Module) -> list[str]:
    """Turn off requires_grad of every declared kernel parameter; returns their qualified names."""
    frozen = []
    for name, kp in named_kernel_parameters(model):
        kp.param.requires_grad_(False)
        frozen.append(name)
    return frozen


def kernel_lr_multipliers(cfg: Config) -> dict[str, float]:
    """The config's LR multiplier per kernel role."""
    o = cfg.optimizer
    return {"frequencies": o.kernel_frequency_lr_multiplier, "temperature": o.kernel_temperature_lr_multiplier}


def group_summary(model: nn.Module, cfg: Config) -> str:
    """The start-up log's one line about the optimizer: its parameter groups, how many tensors decay,
    the groups with another LR, and how many are frozen. No parameter names: a model's dozens of norm
    gains and kernel tensors on one line buried the first screen."""
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay, o.no_decay_patterns, kernel_lr_multipliers(cfg))
    decayed = sum(len(g["params"]) for g in groups if g["name"] == "decay")
    others = [f"{g['name']} {len(g['params'])}" + (f" at lr x {g['lr_multiplier']:g}" if g["lr_multiplier"] != 1 else "")
              for g in groups if g["name"] != "decay"]
    line = (f"optimizer: {len(groups)} parameter groups: {decayed} tensors with weight decay {o.weight_decay:g}, "
            f"{sum(len(g['params']) for g in groups) - decayed} without" + (f" ({', '.join(others)})" if others else ""))
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    return line + (f"; {frozen} frozen (in no group)" if frozen else "")


def declare_zero_supported(optimizer: torch.optim.Optimizer) -> None:
    """Add ``SkippableAdamW`` to DeepSpeed's list of ZeRO-tested optimizers, so that it does not warn
    "You are using ZeRO with an untested optimizer" before step 1. Safe: the list holds torch's
    AdamW but is checked by exact type, and ``SkippableAdamW`` is torch's (fused) AdamW whose
    ``step`` may do nothing; ZeRO uses it only through AdamW's own interface (param_groups, state,
    step). DeepSpeed has no setting that silences the warning (``zero_allow_untested_optimizer``
    only lets the run start); its own code extends the same list (apex FusedAdam, Muon)."""
    if not isinstance(optimizer, SkippableAdamW):
        return  # apex's FusedAdam is in the list when apex is installed
    try:
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    except ImportError:  # another DeepSpeed layout: the warning stays, nothing else changes
        return
    if SkippableAdamW not in ZERO_SUPPORTED_OPTIMIZERS:
        ZERO_SUPPORTED_OPTIMIZERS.append(SkippableAdamW)


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose ``step`` does nothing while ``skip`` is set.

    DeepSpeed (ZeRO or not) calls the wrapped optimizer's ``step`` once per parameter group at
    the gradient-accumulation boundary; the trainer sets ``skip`` (identically on every rank)
    for a step whose loss was non-finite, so the parameters and Adam moments stay untouched
    and the step counter does not advance.
    """

    skip: bool = False
    # ZeRO 0 fp32 only (nothing else checks there): skip when any rank has a non-finite
    # gradient. Collective over the world, so only valid where every rank calls step() once.
    check_finite: bool = False
    skipped_nonfinite_grad: bool = False

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if self.skip:
            return None
        if self.check_finite:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any() if grads else False
            self.skipped_nonfinite_grad = comm.any_rank(bad, comm.world_group())
            if self.skipped_nonfinite_grad:
                return None
        return super().step(closure)


def build_optimizer(cfg: Config, model: nn.Module, device: str) -> torch.optim.Optimizer:
    """The AdamW the DeepSpeed engine wraps (apex FusedAdam when asked and available).
    With ``optimizer.freeze_kernel`` it first freezes the model's kernel parameters."""
    o = cfg.optimizer
    if o.freeze_kernel:
        freeze_kernel_parameters(model)
    groups = param_groups(model, o.weight_decay, o.no_decay_patterns, kernel_lr_multipliers(cfg))
    kwargs = dict(lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if o.use_apex:
        try:
            from apex.optimizers import FusedAdam  # type: ignore[import-not-found]
        except ImportError as e:
            raise ValueError("optimizer.use_apex: apex is not installed; set it to false for torch AdamW") from e
        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    fused = {"on": True, "off": False, "auto": device in ("cuda", "cpu")}[o.fused]
    return SkippableAdamW(groups, fused=fused, **kwargs)


def lr_at(cfg: Config, iteration: int) -> float:
    """Learning rate of optimizer step ``iteration`` (0-based): warmup, then decay to min_lr
    (``wsd``: held at the peak until its decay window, ``ScheduleConfig.decay_window``)."""
    s = cfg.schedule
    decay_first, decay_iters = s.decay_window(cfg.train.train_iters)
    shape = "constant" if s.decay_style == "constant" else s.wsd_decay_shape if s.decay_style == "wsd" else s.decay_style
    return warmup_decay_lr(iteration, cfg.train.lr, s.min_lr, s.warmup_iters, decay_first, decay_iters, shape)


def warmup_decay_lr(step: int, peak: float, min_lr: float, warmup: int, decay_first: int, decay_end: int, shape: str) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up over ``warmup`` steps, the peak until
    ``decay_first``, then ``shape`` (linear, 1-sqrt, cosine; "constant": no decay) down to ``min_lr``
    at ``decay_end``. The trainer's schedule (``lr_at``) and the classifier's (``classify.lr_at``)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if shape == "constant":
        return peak
    if step >= decay_end:
        return min_lr
    if step < decay_first:  # the stable phase of wsd
        return peak
    progress = (step - decay_first) / max(1, decay_end - decay_first)
    return min_lr + decay_factor(shape, progress) * (peak - min_lr)


def decay_factor(shape: str, progress: float) -> float:
    """Share of (peak - min_lr) left at ``progress`` in [0, 1] of the decay."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` x the group's ``lr_multiplier`` into every param group (the DeepSpeed wrapper
    shares the base groups; a group without the key, e.g. from an old checkpoint, counts as 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_multiplier", 1.0)
