"""Optimizer pieces: weight-decay groups, a skippable torch AdamW and the LR schedule.

Weight decay (``param_groups``): matrices decay; every parameter with fewer than 2 dims
(biases, norm gains, Flexformer's per-head tau) and every name matching
``optimizer.no_decay_patterns`` (default: ``omega``, ``tau`` — the learned kernel's
frequencies) does not. Decaying Omega shrinks the frequencies towards a flat kernel and
decaying tau moves the bandwidth; neither is a capacity regulariser. Embeddings decay, as in
Megatron-LM.

The LR schedule is a pure function of the iteration (``lr_at``): the trainer writes it into the
optimizer's param groups before each step, so resuming needs no scheduler state.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from megaflex.training.config import Config


def param_groups(model: nn.Module, weight_decay: float, no_decay_patterns: Iterable[str]) -> list[dict[str, Any]]:
    """Two AdamW groups, ``decay`` and ``no_decay`` (empty groups are dropped)."""
    patterns = [p.lower() for p in no_decay_patterns]
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.dim() < 2 or any(p in name.lower() for p in patterns)
        (no_decay if exempt else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def no_decay_names(model: nn.Module, no_decay_patterns: Iterable[str]) -> list[str]:
    """Names of the parameters ``param_groups`` exempts from decay (for the start-up log)."""
    ids = {id(p) for g in param_groups(model, 1.0, no_decay_patterns) if g["name"] == "no_decay" for p in g["params"]}
    return [n for n, p in model.named_parameters() if id(p) in ids]


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
            bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float() if grads else torch.zeros(())
            if dist.is_initialized():
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self.skipped_nonfinite_grad = bool(bad > 0)
            if self.skipped_nonfinite_grad:
                return None
        return super().step(closure)


def build_optimizer(cfg: Config, model: nn.Module, device: str) -> torch.optim.Optimizer:
    """The AdamW the DeepSpeed engine wraps (apex FusedAdam when asked and available)."""
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay, o.no_decay_patterns)
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
    """Learning rate of optimizer step ``iteration`` (0-based): warmup, then decay to min_lr."""
    s, peak = cfg.schedule, cfg.train.lr
    decay_iters = s.decay_iters if s.decay_iters is not None else cfg.train.train_iters
    if s.warmup_iters > 0 and iteration < s.warmup_iters:
        return peak * (iteration + 1) / s.warmup_iters
    if s.decay_style == "constant":
        return peak
    if iteration >= decay_iters:
        return s.min_lr
    progress = (iteration - s.warmup_iters) / max(1, decay_iters - s.warmup_iters)
    if s.decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr + coeff * (peak - s.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (the DeepSpeed wrapper shares the base groups)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
