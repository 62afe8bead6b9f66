"""Per-layer statistics of the attention kernel, for training logs and the kernel study.

Parameter statistics come from the feature maps' declared kernel parameters
(``megaflex.attention.named_kernel_parameters``), never from parameter names or shapes:

* ``layerXX/tau_{mean,min,max}`` for "temperature" parameters (over heads);
* ``layerXX/{name}_norm_{mean,min,max}`` over the frequency rows of "frequencies" parameters;
* ``layerXX/{name}_rel_change`` = ||P - P_init|| / ||P_init|| for every kernel parameter, given a
  ``reference`` snapshot (``kernel_snapshot`` at step 0); ``layerXX/{name}_change`` = ||P - P_init||
  instead for one initialised to zeros (a log-gain, a mix logit), where a ratio means nothing.

Probe statistics (given ``probe_ids``: a fixed batch, so values are comparable over training)
from the explicit causal weights of every layer (``megaflex.attention.diagnostics``), softmax
layers included: ``layerXX/negative_fraction`` and ``layerXX/effective_keys``; for the
one-normaliser window hybrid these use its own weights and ``layerXX/far_share`` (the far field's
share of the attention mass) is added. Beside them the norms of the queries and keys that enter the
feature map (after RoPE, the optional q/k norm and convolution): ``layerXX/{q,k}_norm_{mean,p90}``,
the mean and 90th percentile of ||q_t|| (per head, over the head dim) over every head and token of
the probe batch; selective attention needs large |q.k|, which a random-feature kernel can only get
from large norms, where its estimate is worst.
Under tensor parallelism everything covers this rank's heads only.
"""

from __future__ import annotations

import torch
from torch import nn

from megaflex.attention import named_kernel_parameters
from megaflex.attention.diagnostics import causal_weights, far_share, weight_statistics, window_causal_weights


def kernel_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every kernel parameter (qualified name -> fp32 CPU tensor)."""
    return {name: kp.param.detach().float().cpu().clone() for name, kp in named_kernel_parameters(model)}


@torch.no_grad()
def kernel_statistics(
    model: nn.Module, probe_ids: torch.Tensor | None = None, reference: dict[str, torch.Tensor] | None = None
) -> dict[str, float]:
    """Flat scalar statistics per layer (see the module docstring); ``model`` is a ``GPT``."""
    stats: dict[str, float] = {}
    for i, block in enumerate(model.blocks):
        prefix = f"layer{i:02d}"
        # the core's parameters and the attention layer's own (the q/k norm's gain)
        for name, kp in named_kernel_parameters(block.attn):
            values = kp.param.detach().float()
            if kp.role == "temperature":
                _summary(stats, f"{prefix}/{kp.name}", values)
            elif kp.role == "frequencies":
                _summary(stats, f"{prefix}/{kp.name}_norm", values.norm(dim=-1))
            full = f"blocks.{i}.attn.{name}"
            if reference is not None and full in reference:
                init = reference[full].to(values.device)
                change, size = (values - init).norm().item(), init.norm().item()
                if size > 0:
                    stats[f"{prefix}/{kp.name}_rel_change"] = change / size
                else:
                    stats[f"{prefix}/{kp.name}_change"] = change
    if probe_ids is not None:
        stats.update(_probe_statistics(model, probe_ids))
    return stats


def _summary(stats: dict[str, float], key: str, values: torch.Tensor) -> None:
    stats[f"{key}_mean"] = values.mean().item()
    stats[f"{key}_min"] = values.min().item()
    stats[f"{key}_max"] = values.max().item()


def _probe_statistics(model: nn.Module, probe_ids: torch.Tensor) -> dict[str, float]:
    """Run the probe batch once, catching each core's (q, k), and measure its causal weights."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mapped: dict[int, list[torch.Tensor]] = {}
    # the linear/softmax core itself (inside a LocalMixingCore: after the q/k/v convolution)
    cores = [getattr(block.attn.core, "core", block.attn.core) for block in model.blocks]
    hooks = [
        core.register_forward_pre_hook(lambda _m, args, i=i: captured.__setitem__(i, (args[0], args[1])))
        for i, core in enumerate(cores)
    ]
    # a layer factory may bypass the core's forward (context parallelism calls its feature map on
    # q, then k, of this rank's slice): catch those inputs too
    hooks += [
        core.feature_map.register_forward_pre_hook(lambda _m, args, i=i: mapped.setdefault(i, []).append(args[0]))
        for i, core in enumerate(cores)
        if core.feature_map is not None and not _shared_window(model.blocks[i].attn.core)
    ]
    # the one-normaliser window hybrid calls no core forward: its tap sees the (convolved) q, k
    hooks += [
        block.attn.core.qk_tap.register_forward_pre_hook(lambda _m, args, i=i: captured.__setitem__(i, (args[0], args[1])))
        for i, block in enumerate(model.blocks)
        if _shared_window(block.attn.core)
    ]
    was_training = model.training
    model.eval()
    try:
        model(probe_ids)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    stats: dict[str, float] = {}
    for i, core in enumerate(cores):
        q, k = captured[i] if i in captured else mapped[i][:2]
        window = _shared_window(model.blocks[i].attn.core)
        log_decay = core.log_decay()
        if window:
            weights = window_causal_weights(q, k, core.feature_map, window, model.blocks[i].attn.core.far_log_gain,
                                            log_decay)  # fmt: skip
            if q.shape[2] > window:  # else there is no far field to measure (and no NaN in the logs)
                stats[f"layer{i:02d}/far_share"] = far_share(weights, window)
        else:
            weights = causal_weights(q, k, core.feature_map, log_decay)
        for key, value in weight_statistics(weights).items():
            stats[f"layer{i:02d}/{key}"] = value
        for name, x in (("q", q), ("k", k)):
            norms = x.detach().float().norm(dim=-1).flatten()  # ||x_t|| per (batch, head, token)
            stats[f"layer{i:02d}/{name}_norm_mean"] = norms.mean().item()
            stats[f"layer{i:02d}/{name}_norm_p90"] = torch.quantile(norms, 0.9).item()
    return stats


def _shared_window(core: nn.Module) -> int:
    """W of a one-normaliser window hybrid core, else 0."""
    return getattr(core, "window", 0) if getattr(core, "mixing", None) == "shared_normaliser" else 0
