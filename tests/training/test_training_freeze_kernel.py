"""optimizer.freeze_kernel: every declared kernel parameter (any kind) stays fixed, the rest trains."""

from __future__ import annotations

import pytest
import torch

from megaflex.attention import named_kernel_parameters
from megaflex.model import GPT, ModelConfig
from megaflex.training.config import Config
from megaflex.training.optim import build_optimizer, group_summary, set_lr


def tiny_config(attention: str, **optimizer) -> Config:
    model = ModelConfig(vocab_size=97, num_layers=2, hidden_size=32, num_heads=2, ffn_hidden_size=64,
                        attention=attention, feature_dim=16, chunk_size=8, max_seq_len=64, init_std=0.2)
    cfg = Config(model=model)
    for key, value in optimizer.items():
        setattr(cfg.optimizer, key, value)
    return cfg


@pytest.mark.parametrize("attention", ["flexformer_n", "hedgehog", "flexformer_s"])
def test_freeze_kernel_keeps_every_kernel_parameter_and_trains_the_rest(attention: str) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(attention, freeze_kernel=True, fused="off")
    model = GPT(cfg.model)
    kernel = dict(named_kernel_parameters(model))
    assert kernel  # these kinds have learnable maps
    optimizer = build_optimizer(cfg, model, "cpu")
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all(id(kp.param) not in in_groups and not kp.param.requires_grad for kp in kernel.values())
    assert {"kernel_frequencies", "kernel_temperature"}.isdisjoint(g["name"] for g in optimizer.param_groups)
    assert "frozen (no group): " + ", ".join(kernel) in group_summary(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    set_lr(optimizer, 1e-2)
    for _ in range(2):
        ids = torch.randint(0, 97, (2, 20))
        model(ids, labels=torch.randint(0, 97, (2, 20))).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        same = torch.equal(param.detach(), before[name])
        assert same == (name in kernel), name


def test_without_freeze_kernel_a_hedgehog_map_weight_trains() -> None:
    torch.manual_seed(0)
    cfg = tiny_config("hedgehog", fused="off")
    model = GPT(cfg.model)
    optimizer = build_optimizer(cfg, model, "cpu")
    w = model.blocks[0].attn.core.feature_map.W
    before = w.detach().clone()
    set_lr(optimizer, 1e-2)
    model(torch.randint(0, 97, (2, 20)), labels=torch.randint(0, 97, (2, 20))).loss.backward()
    optimizer.step()
    assert w.requires_grad and not torch.equal(w.detach(), before)
    assert "frozen" not in group_summary(model, cfg)
