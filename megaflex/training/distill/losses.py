"""The losses of distillation: per-layer attention transfer and the teacher KL of finetuning.

Attention transfer (stage 1) runs the teacher once per micro-batch with ``AttentionTap`` hooks
that keep, per block, the input of its attention (the normed hidden states) and the attention's
output. Each student block's attention then runs on the *teacher's* input, so every layer is
trained against the teacher on the same inputs (no error accumulated from the student's own
earlier layers; the layers still train jointly, in one backward). With the teacher's q/k/v/o
weights copied and frozen, the student sees exactly the teacher's q, k, v (after RoPE).

* ``output_mse``: mean squared error of the attention outputs (after the output projection).
* ``weights_kl``: cross-entropy between the teacher's softmax weights and the student's
  normalised linear weights on the first W tokens (quadratic form, Hedgehog), minus the
  teacher's entropy: the KL divergence, 0 at a perfect match, with the cross-entropy's gradient.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megaflex.parallel import comm

_TINY = 1e-12  # floor of the student's weights inside the log (non-positive maps can give 0 or less)


class AttentionTap:
    """Forward hooks on every ``block.attn`` (and its core) of a GPT: after a forward,
    ``inputs[i]`` / ``outputs[i]`` are block i's attention input and output, ``qk[i]`` its (q, k)."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []
        for block in model.blocks:
            block.attn.register_forward_pre_hook(lambda _m, args: self.inputs.append(args[0]))
            block.attn.register_forward_hook(lambda _m, _args, out: self.outputs.append(out[0]))
            block.attn.core.register_forward_pre_hook(lambda _m, args: self.qk.append((args[0], args[1])))

    def clear(self) -> None:
        self.inputs, self.outputs, self.qk = [], [], []


@contextmanager
def captured_qk(core: nn.Module) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within the block: the (q, k) of every call of ``core`` (an attention core)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = core.register_forward_pre_hook(lambda _m, args: seen.append((args[0], args[1])))
    try:
        yield seen
    finally:
        handle.remove()


def supports_attention_weights(core: nn.Module) -> bool:
    """Whether ``attention_weights`` can materialise this core's weights (softmax or a plain feature map)."""
    if getattr(core, "window", 0) or getattr(core, "conv_size", 0):  # a LocalMixingCore: not a plain kernel
        return False
    return getattr(core, "kind", None) == "softmax" or getattr(core, "feature_map", None) is not None


def attention_weights(core: nn.Module, q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention weights [B, H, W, W] (rows sum to 1, fp32) of ``core`` on the first
    ``window`` tokens of q, k [B, H, N, d]: softmax(q k^T / sqrt(d)) for softmax, otherwise the
    linear kernel's phi(q_t) . phi(k_s) exp(log_scale_s) over s <= t, normalised per row
    (negative values, possible with random trig features, count as 0)."""
    q, k = q[:, :, :window].float(), k[:, :, :window].float()
    w = q.shape[2]
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
    if getattr(core, "kind", None) == "softmax":
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    q_map, k_map = core.feature_map(q), core.feature_map(k)
    weights = q_map.features.float() @ k_map.features.float().transpose(-1, -2)  # [B, H, W, W]
    if k_map.log_scale is not None:
        ls = k_map.log_scale.float()
        # one constant per (B, H) cancels in the normalisation; it only keeps exp() finite
        weights = weights * torch.exp(ls - ls.detach().amax(dim=-1, keepdim=True)).unsqueeze(-2)
    weights = weights.clamp(min=0).masked_fill(~causal, 0.0)
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=_TINY)


def output_mse(student_out: torch.Tensor, teacher_out: torch.Tensor) -> torch.Tensor:
    """Mean squared error of two attention outputs [B, N, h], in fp32."""
    return (student_out.float() - teacher_out.float()).pow(2).mean()


def weights_kl(teacher: torch.Tensor, student: torch.Tensor, total_heads: int) -> torch.Tensor:
    """sum_s p_t (log p_t - log p_s) of [B, H_local, W, W] weights, summed over this rank's heads
    and divided by B x W x ``total_heads`` (so the TP sum over ranks is the mean over every head)."""
    # the same floor on both sides: identical weights give exactly 0
    kl = teacher * (torch.log(teacher.clamp(min=_TINY)) - torch.log(student.clamp(min=_TINY)))
    return kl.sum() / (teacher.shape[0] * teacher.shape[2] * total_heads)


def logits_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor, ignore: int) -> torch.Tensor:
    """Mean over the labelled tokens of KL(softmax(teacher) || softmax(student)), full-vocab logits [B, N, V]."""
    log_t = F.log_softmax(teacher_logits.float(), dim=-1)
    log_s = F.log_softmax(student_logits.float(), dim=-1)
    per_token = (log_t.exp() * (log_t - log_s)).sum(dim=-1)  # [B, N]
    valid = labels != ignore
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def tp_sum(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``local`` over the TP group as a value, with ``local``'s own gradient: each
    rank differentiates only its heads' share, which is all its own parameters receive anyway."""
    if comm.group_size(group) == 1:
        return local
    return local + (comm.reduced(local, "sum", group) - local.detach())
