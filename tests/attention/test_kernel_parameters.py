"""Kernel parameters declare themselves: optimizer groups, TP tags, statistics, FLOPs, init options."""

from __future__ import annotations

import math

import pytest
import torch

from megaflex.attention import (
    FEATURE_MAP_KINDS,
    AttentionCore,
    build_feature_map,
    causal_linear_attention,
    feature_dim_of,
    named_kernel_parameters,
)
from megaflex.attention.base import FeatureMap, KernelParameter
from megaflex.attention.diagnostics import causal_weights, weight_statistics
from megaflex.model import GPT, ModelConfig
from megaflex.model.kernel_stats import kernel_snapshot
from megaflex.parallel.layers import mark_head_sharded_params
from megaflex.training.metrics import flops_per_token
from megaflex.training.optim import param_groups, set_lr
from attention_helpers import form_steps, make_qkv
from numerics import assert_close

D = 16


def tiny(attention: str = "flexformer_n", **overrides) -> ModelConfig:
    values = dict(vocab_size=97, num_layers=2, hidden_size=32, num_heads=2, ffn_hidden_size=64, attention=attention,
                  feature_dim=16, chunk_size=8, max_seq_len=64, init_std=0.2)
    return ModelConfig(**{**values, **overrides})


@pytest.mark.parametrize("kind", FEATURE_MAP_KINDS)
def test_every_map_declares_exactly_its_parameters_with_heads_on_dim0(kind):
    fmap = build_feature_map(kind, 3, D, 16)
    declared = dict(named_kernel_parameters(fmap))
    assert set(declared) == {n for n, _ in fmap.named_parameters()}
    for kp in declared.values():
        assert kp.param.shape[0] == 3  # TP shards heads on dim 0


def test_an_undeclared_parameter_is_an_error():
    class Forgetful(FeatureMap):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads, self.head_dim, self.feature_dim = 1, 2, 2
            self.w = torch.nn.Parameter(torch.ones(1, 2))

    with pytest.raises(ValueError, match="Forgetful.kernel_parameters"):
        list(named_kernel_parameters(Forgetful()))
    with pytest.raises(ValueError, match="role"):
        KernelParameter("w", torch.nn.Parameter(torch.ones(1)), "bandwidth")


def group_names(model: torch.nn.Module, groups: list[dict]) -> dict[str, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}


def test_param_groups_put_the_kernel_in_its_lr_groups_without_decay():
    torch.manual_seed(0)
    model = GPT(tiny())
    groups = param_groups(model, 0.1, [], {"frequencies": 10.0, "temperature": 30.0})
    by_name = {g["name"]: g for g in groups}
    names = group_names(model, groups)
    assert names["kernel_frequencies"] == {f"blocks.{i}.attn.core.feature_map.omega{j}" for i in (0, 1) for j in (1, 2)}
    assert names["kernel_temperature"] == {f"blocks.{i}.attn.core.{name}" for i in (0, 1)
                                           for name in ("feature_map.tau", "decay_logit")}  # the default decay
    assert by_name["kernel_frequencies"]["lr_multiplier"] == 10.0 and by_name["kernel_temperature"]["weight_decay"] == 0.0
    assert all(model.get_parameter(n).dim() == 2 for n in names["decay"])
    assert set().union(*names.values()) == {n for n, _ in model.named_parameters()}
    # multipliers 1: no kernel groups (the two groups of older checkpoints), kernel still undecayed
    plain = group_names(model, param_groups(model, 0.1))
    assert set(plain) == {"decay", "no_decay"} and "blocks.0.attn.core.feature_map.omega1" in plain["no_decay"]


def test_hedgehog_map_weight_is_not_decayed():
    torch.manual_seed(0)
    model = GPT(tiny("hedgehog"))
    names = group_names(model, param_groups(model, 0.1, [], {"frequencies": 10.0}))
    assert "blocks.0.attn.core.feature_map.W" in names["no_decay"]
    assert not any(n.endswith(".W") for n in names["decay"]) and "kernel_frequencies" not in names


def test_set_lr_applies_the_multipliers_and_zero_freezes_omega():
    torch.manual_seed(0)
    model = GPT(tiny())
    groups = param_groups(model, 0.1, [], {"frequencies": 0.0, "temperature": 5.0})
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    set_lr(optimizer, 1e-2)
    assert {g["name"]: g["lr"] for g in optimizer.param_groups}["kernel_temperature"] == pytest.approx(5e-2)
    fmap = model.blocks[0].attn.core.feature_map
    before = kernel_snapshot(model)
    model(torch.randint(0, 97, (2, 12)), labels=torch.randint(0, 97, (2, 12))).loss.backward()
    optimizer.step()
    assert torch.equal(fmap.omega1.detach(), before["blocks.0.attn.core.feature_map.omega1"])
    assert not torch.equal(fmap.tau.detach(), before["blocks.0.attn.core.feature_map.tau"])


def test_tp_marking_tags_exactly_the_declared_kernel_parameters():
    torch.manual_seed(0)
    model = GPT(tiny(qkv_conv_size=3))
    count = mark_head_sharded_params(model)
    declared = {n for n, _ in named_kernel_parameters(model)}
    assert count == len(declared) == 2 * 5  # omega1, omega2, tau, the decay (the default), conv taps per layer
    # out_gain is tagged by the model itself (not a kernel parameter)
    tagged = {n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)} - {
        f"blocks.{i}.attn.out_gain" for i in (0, 1)
    }
    assert tagged == declared and all(model.get_parameter(n).partition_dim == 0 for n in tagged)


@pytest.mark.parametrize("kind,expected", [("elu", D), ("cosformer", 2 * D), ("flexformer_n", 64), ("hedgehog", 64)])
def test_flops_use_the_maps_real_feature_dim(kind, expected):
    assert feature_dim_of(kind, D, 64) == expected == build_feature_map(kind, 2, D, 64).feature_dim
    cfg = tiny(kind, feature_dim=64, hidden_size=32)  # head_dim 16
    h, heads, c = 32, 2, 8
    attn = 8.0 * h * expected + 2.0 * c * (expected + D) * heads
    assert flops_per_token(cfg, 64, 1000) == pytest.approx(6.0 * 1000 + 3.0 * 2 * attn)


def test_tied_init_is_close_but_not_equal_and_draws_like_the_paper_init():
    # that it estimates exp(q.k / sqrt d) without the floor: test_attention_feature_maps ESTIMATORS
    torch.manual_seed(1)
    tied = build_feature_map("flexformer_n", 8, D, 64, omega_init="tied", omega_noise=0.1)
    after_tied = torch.rand(1)
    torch.manual_seed(1)
    paper = build_feature_map("flexformer_n", 8, D, 64, omega_init="paper")
    assert torch.equal(torch.rand(1), after_tied)  # same RNG consumption: the rest of the model's init is unchanged
    assert torch.equal(tied.omega1, paper.omega1)
    torch.testing.assert_close(tied.omega2, paper.omega1 + 0.1 * paper.omega2)
    gap = (tied.omega2 - tied.omega1).norm() / tied.omega1.norm()
    assert 0.05 < gap.item() < 0.2  # close, but not equal: the O1 <-> O2 symmetry is broken
    with pytest.raises(ValueError, match="omega_init"):
        build_feature_map("flexformer_n", 2, D, 16, omega_init="zeros")
    with pytest.raises(ValueError, match="omega_noise"):
        build_feature_map("flexformer_n", 2, D, 16, omega_noise=0.0)


@pytest.mark.parametrize("kind", ["flexformer_n", "performer", "elu", "cosformer"])
def test_causal_weights_reproduce_the_quadratic_form(kind):
    torch.manual_seed(0)
    fmap = build_feature_map(kind, 2, D, 32, **({"max_seq_len": 64} if kind == "cosformer" else {}))
    q, k, v = make_qkv(2, 2, 11, D, seed=3)
    weights = causal_weights(q, k, fmap)
    want, _ = causal_linear_attention(fmap(q).features, fmap(k).features, fmap(k).log_scale, v, form="quadratic",
                                      normalization="denominator", eps=1e-12)
    # the explicit weights' n-term sums and a division vs the quadratic form (tests/numerics.py)
    assert_close((weights @ v) / weights.sum(-1, keepdim=True), want, steps=form_steps(fmap, q, k, v) + 2 * 11 + 2)
    assert (weights.triu(1) == 0).all()


def test_weight_statistics_on_known_weights():
    n = 4
    uniform = torch.tril(torch.ones(1, 1, n, n))
    stats = weight_statistics(uniform)
    assert stats["effective_keys"] == pytest.approx(sum(range(1, n + 1)) / n)  # t + 1 keys for query t
    assert stats["negative_fraction"] == 0.0
    signed = uniform.clone()
    signed[0, 0, 3, 0] = -1.0  # 1 of the 10 causal weights
    assert weight_statistics(signed)["negative_fraction"] == pytest.approx(0.1)
    assert weight_statistics(torch.eye(n).view(1, 1, n, n))["effective_keys"] == pytest.approx(1.0)


def test_kernel_statistics_report_change_since_init_and_probe_weights():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    reference = kernel_snapshot(model)
    with torch.no_grad():
        model.blocks[1].attn.core.feature_map.omega1.mul_(1.5)
    probe = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    stats = model.kernel_statistics(probe, reference)
    assert stats["layer01/omega1_rel_change"] == pytest.approx(0.5, rel=1e-5)
    assert stats["layer00/omega1_rel_change"] == 0.0 and stats["layer01/tau_rel_change"] == 0.0
    assert 1.0 <= stats["layer00/effective_keys"] <= 10.0 and 0.0 <= stats["layer00/negative_fraction"] <= 1.0
    softmax = GPT(tiny("softmax")).eval().kernel_statistics(probe)
    probe_keys = ("negative_fraction", "effective_keys", "q_norm_mean", "q_norm_p90", "k_norm_mean", "k_norm_p90")
    assert set(softmax) == {f"layer0{i}/{k}" for i in (0, 1) for k in probe_keys}
    assert softmax["layer00/negative_fraction"] == 0.0


@pytest.mark.parametrize("overrides", [{}, {"softmax_window": 4, "qkv_conv_size": 2}], ids=["plain", "window+conv"])
def test_kernel_statistics_report_the_norms_of_q_and_k_entering_the_feature_map(overrides):
    torch.manual_seed(0)
    model = GPT(tiny(**overrides)).eval()
    probe = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []  # what the feature map is called with: q, then k, per layer
    hooks = [b.attn.core.feature_map.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
             for b in model.blocks]
    stats = model.kernel_statistics(probe)
    for h in hooks:
        h.remove()
    q, k = seen[0], seen[1]  # layer 0's first forward (the probe's; the causal weights map them again)
    for name, x in (("q", q), ("k", k)):
        norms = x.norm(dim=-1).flatten()
        assert stats[f"layer00/{name}_norm_mean"] == pytest.approx(norms.mean().item(), rel=1e-6)
        assert stats[f"layer00/{name}_norm_p90"] == pytest.approx(norms.sort().values[int(0.9 * (norms.numel() - 1))].item(),
                                                                 rel=0.05)
    # with the q/k norm at gain g: every norm is g sqrt(d), and the gain is logged beside tau
    normed = GPT(tiny(qk_norm="rms")).eval()
    with torch.no_grad():
        normed.blocks[1].attn.qk_norm.log_gain.fill_(math.log(2.0))
    stats = normed.kernel_statistics(probe)
    assert stats["layer01/q_norm_mean"] == pytest.approx(2.0 * math.sqrt(D), rel=1e-4)
    assert stats["layer01/k_norm_p90"] == pytest.approx(2.0 * math.sqrt(D), rel=1e-4)
    assert stats["layer01/log_gain_mean"] == pytest.approx(math.log(2.0)) and stats["layer00/log_gain_mean"] == 0.0
    # a zero-initialised parameter's change is absolute (a ratio to a zero norm means nothing)
    changed = normed.kernel_statistics(None, {**kernel_snapshot(normed), "blocks.1.attn.qk_norm.log_gain": torch.zeros(2, 1, 1)})
    assert changed["layer01/log_gain_change"] == pytest.approx(math.sqrt(2) * math.log(2.0))  # ||ln 2 x 1_[2 heads]||
    assert "layer01/log_gain_rel_change" not in changed and changed["layer01/tau_rel_change"] == 0.0


def test_core_declares_nothing_itself():
    core = AttentionCore("flexformer_n", 2, D, feature_dim=16)
    assert {n for n, _ in named_kernel_parameters(core)} == {"feature_map.omega1", "feature_map.omega2", "feature_map.tau"}
