"""LoRA adapters for the projections of a (tensor-parallel) GPT: y = W x + (alpha / r) B A x.

Used by the finetune stage of distillation (LoLCATs: LoRA r=8 on q/k/v/o). ``add_lora`` hangs a
``LoRAAdapter`` under each target linear (``blocks.0.attn.qkv.lora.A`` / ``.B``) plus a forward
hook that adds the adapter's update to the linear's output. The linear itself (its class,
parameter names, TP tags) is untouched, so ``merge_lora`` only folds B @ A into its weight and
unhooks, leaving a model whose state dict is a normal megaflex checkpoint's.

Shapes per kind of linear (x: the linear's input; s = alpha / r):

    nn.Linear (plain model) A [r, in]               B [out, r]               y += s B (A x)
    ColumnParallelLinear     A [r, in] replicated    B [out/tp, r] dim 0      y_shard += s B copy(A x)
    RowParallelLinear        A [r, in/tp] dim 1      B [out, r] replicated    y += s B reduce(A x_shard)

``copy`` (identity forward, all-reduce backward) makes the replicated A's gradient the sum over
all output shards, the same on every TP rank; ``reduce`` sums the row-parallel partial products.
Each costs one all-reduce of [..., r]. Sharded adapters are tagged like the layers' own weights
(``set_tensor_parallel_attributes``), so DeepSpeed's grad norm, ZeRO and ``reshard`` see them.

Init: B = 0 (the model is unchanged at start); A ~ U(-1/sqrt(in), 1/sqrt(in)) drawn as the full
[r, in] matrix from the default RNG, which every TP rank seeds identically (row-parallel ranks
keep their slice). So after the same seed a TP=k adapter holds exactly the slices of the TP=1 one.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megaflex.model.gpt import MLP, Attention
from megaflex.parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tensor_parallel_attributes
from megaflex.parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)

# target name -> (module class holding the linear, attribute name of the linear)
LORA_TARGETS: dict[str, tuple[type[nn.Module], str]] = {
    "qkv": (Attention, "qkv"),
    "proj": (Attention, "proj"),
    "fc_in": (MLP, "fc_in"),
    "fc_out": (MLP, "fc_out"),
}
_FROZEN_BY_LORA = "_frozen_by_lora"  # model attribute: parameter names add_lora froze


class LoRAAdapter(nn.Module):
    """The low-rank update s * B @ A of one linear; ``forward(x)`` takes that linear's input."""

    def __init__(self, linear: nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        if isinstance(linear, ColumnParallelLinear):
            self.kind, tp = "column", linear.state.tp_size
        elif isinstance(linear, RowParallelLinear):
            self.kind, tp = "row", linear.state.tp_size
        elif isinstance(linear, nn.Linear):
            self.kind, tp = "local", 1
        else:
            raise TypeError(f"linear: expected nn.Linear, ColumnParallelLinear or RowParallelLinear, "
                            f"got {type(linear).__name__}")
        self.linear_state = getattr(linear, "state", None)  # ParallelState of the TP layers
        self.gather_output = getattr(linear, "gather_output", False)
        self.input_is_parallel = getattr(linear, "input_is_parallel", True)
        in_features, out_features = linear.in_features, linear.out_features
        if rank > min(in_features, out_features):
            raise ValueError(f"rank: expected <= min(in, out) = {min(in_features, out_features)} "
                             f"for a {in_features} -> {out_features} linear, got {rank}")
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        weight = linear.weight
        full_a = torch.empty(rank, in_features, device=weight.device, dtype=torch.float32)
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(full_a, -bound, bound)  # default RNG: identical on every TP rank
        if self.kind == "row":
            full_a = full_a.chunk(tp, dim=1)[linear.state.tp_rank]
        self.A = nn.Parameter(full_a.to(weight.dtype).contiguous())  # [r, in] or [r, in / tp]
        self.B = nn.Parameter(torch.zeros(out_features // tp if self.kind == "column" else out_features,
                                          rank, device=weight.device, dtype=weight.dtype))
        if self.kind == "column":
            set_tensor_parallel_attributes(self.B, 0)
        elif self.kind == "row":
            set_tensor_parallel_attributes(self.A, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear's input x -> the update to add to its output (same shape and sharding)."""
        if self.kind == "local":
            return self.scale * F.linear(F.linear(x, self.A), self.B)
        if self.kind == "column":
            h = copy_to_tp_region(F.linear(x, self.A), self.linear_state)  # [..., r], grad summed over shards
            y = self.scale * F.linear(h, self.B)  # [..., out / tp]
            return gather_from_tp_region(y, self.linear_state) if self.gather_output else y
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.linear_state)
        h = reduce_from_tp_region(F.linear(x, self.A), self.linear_state)  # [..., r], full
        return self.scale * F.linear(h, self.B)  # [..., out]

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A in fp32, shaped like this rank's shard of the linear's weight."""
        return self.scale * (self.B.float() @ self.A.float())

    def extra_repr(self) -> str:
        return f"kind={self.kind}, rank={self.rank}, alpha={self.alpha:g}, A={tuple(self.A.shape)}, B={tuple(self.B.shape)}"


def _add_update(linear: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a LoRA-wrapped linear: its output plus the adapter's update."""
    if not args:
        raise TypeError(f"{type(linear).__name__} with LoRA: pass the input positionally")
    return output + linear.lora(args[0])


def _target_linears(model: nn.Module, targets: Iterable[str] | str) -> list[tuple[str, nn.Module]]:
    """(qualified name, linear) of every target linear in ``model``, in module order."""
    names = [targets] if isinstance(targets, str) else list(targets)
    if not names:
        raise ValueError(f"targets: expected at least one of {sorted(LORA_TARGETS)}, got none")
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"targets: unknown {unknown}; known: {sorted(LORA_TARGETS)}")
    found = []
    for module_name, module in model.named_modules():
        for target in dict.fromkeys(names):
            owner, attr = LORA_TARGETS[target]
            if isinstance(module, owner):
                found.append((f"{module_name}.{attr}", getattr(module, attr)))
    if not found:
        raise ValueError(f"model: no Attention/MLP modules found for targets {names} "
                         f"(expected a megaflex GPT, got {type(model).__name__})")
    return found


def add_lora(
    model: nn.Module, rank: int, alpha: float, targets: Iterable[str] | str = ("qkv", "proj")
) -> list[nn.Parameter]:
    """Add rank-``rank`` LoRA adapters (scale ``alpha / rank``) to the ``targets`` linears of every
    block, freeze every other parameter and return the adapters' parameters (A, B per linear).

    ``targets``: "qkv" (fused q/k/v), "proj" (attention output), "fc_in", "fc_out" (MLP).
    The model's output is unchanged until the B matrices move. Build the optimizer afterwards
    (``megaflex.training.optim.param_groups`` skips frozen parameters).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: expected an integer >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha: expected a finite number > 0, got {alpha!r}")
    linears = _target_linears(model, targets)
    wrapped = [name for name, linear in linears if hasattr(linear, "lora")]
    if wrapped:
        raise ValueError(f"model: {wrapped[0]} already has a LoRA adapter; call merge_lora first")
    adapters = [LoRAAdapter(linear, rank, float(alpha)) for _, linear in linears]  # all checks before any change
    frozen = [name for name, p in model.named_parameters() if p.requires_grad]
    for p in model.parameters():
        p.requires_grad_(False)
    setattr(model, _FROZEN_BY_LORA, frozen)
    for (_, linear), adapter in zip(linears, adapters):
        linear.lora = adapter
        linear.lora_hook = linear.register_forward_hook(_add_update)
    return lora_parameters(model)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA parameters of ``model`` (A, B of each adapter, in module order)."""
    return [p for m in model.modules() if isinstance(m, LoRAAdapter) for p in (m.A, m.B)]


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter's s * B @ A into its linear's weight, remove the adapters and hooks and
    unfreeze what ``add_lora`` froze. Returns the number of merged linears.

    Afterwards the state dict has exactly the names and shapes of the model without LoRA. Under
    DeepSpeed, call it on ``engine.module`` when training is over (ZeRO 0-2: each rank holds its
    full TP shard; the optimizer's master weights are not updated).
    """
    linears = [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoRAAdapter)]
    if not linears:
        raise ValueError(f"model: no LoRA adapters to merge in {type(model).__name__}")
    with torch.no_grad():
        for linear in linears:
            weight = linear.weight
            weight.copy_((weight.float() + linear.lora.delta_weight()).to(weight.dtype))
            linear.lora_hook.remove()
            del linear.lora, linear.lora_hook
    params = dict(model.named_parameters())
    for name in getattr(model, _FROZEN_BY_LORA, []):
        params[name].requires_grad_(True)
    if hasattr(model, _FROZEN_BY_LORA):
        delattr(model, _FROZEN_BY_LORA)
    return len(linears)
