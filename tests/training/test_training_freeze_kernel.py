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
    assert group_summary(model, cfg).endswith(f"; {len(kernel)} frozen (in no group)")
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


def test_the_group_summary_is_one_line_of_counts() -> None:
    """Issue 45: the start-up log listed every no-decay parameter by name on one line (dozens on a
    real model); now one line of counts, and no parameter name."""
    cfg = tiny_config("flexformer_n")
    model = GPT(cfg.model)
    groups = {g["name"]: len(g["params"]) for g in build_optimizer(cfg, model, "cpu").param_groups}
    summary = group_summary(model, cfg)
    assert summary == (f"optimizer: 4 parameter groups: {groups['decay']} tensors with weight decay 0.1, "
                       f"{groups['no_decay'] + groups['kernel_frequencies'] + groups['kernel_temperature']} without "
                       f"(no_decay {groups['no_decay']}, kernel_frequencies {groups['kernel_frequencies']} at lr x 10, "
                       f"kernel_temperature {groups['kernel_temperature']} at lr x 10)")
    assert not any(name in summary for name, _ in model.named_parameters())


def test_deepspeed_counts_the_trainers_adamw_as_tested(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45: DeepSpeed warned "untested optimizer" before step 1 (its list holds torch's AdamW by
    exact type, not the trainer's subclass)."""
    from deepspeed.runtime.zero import utils as zero_utils

    from megaflex.training.optim import declare_zero_supported

    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", list(zero_utils.ZERO_SUPPORTED_OPTIMIZERS))
    monkeypatch.setattr(zero_utils.dist, "get_rank", lambda: 1)  # no process group here
    cfg = tiny_config("flexformer_n", fused="off")
    optimizer = build_optimizer(cfg, GPT(cfg.model), "cpu")
    assert not zero_utils.is_zero_supported_optimizer(optimizer)
    declare_zero_supported(optimizer)
    assert zero_utils.is_zero_supported_optimizer(optimizer)
    declare_zero_supported(optimizer)  # once in the list
    assert zero_utils.ZERO_SUPPORTED_OPTIMIZERS.count(type(optimizer)) == 1
