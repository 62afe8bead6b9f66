"""model.qk_norm (attention/qk_norm.py): the norms it sets, the same q, k for every attention form,
a parameter-free and draw-free default, and a TP layout with whole heads."""

from __future__ import annotations

import math

import pytest
import torch

from megaflex.attention.qk_norm import QKNorm
from megaflex.model import GPT, ModelConfig
from numerics import assert_close, gpt_steps
from test_model import build, ids, shard_attention, tiny_config

pytestmark = pytest.mark.numerics


def captured_core_inputs(model: GPT, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, k) as each layer's attention core receives them on ``model(x)``."""
    got = []
    hooks = [b.attn.core.register_forward_pre_hook(lambda _m, args: got.append((args[0], args[1]))) for b in model.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("kind", ["rms", "affine_rms"])
def test_q_and_k_enter_the_core_with_the_learned_norm(kind: str) -> None:
    model = build(tiny_config(qk_norm=kind))
    norm = model.blocks[0].attn.qk_norm
    gains = torch.tensor([0.5, 1.0, 2.0, 3.0])
    with torch.no_grad():
        if kind == "rms":
            norm.log_gain.copy_(gains.log().view(4, 1, 1))
        else:  # a uniform channel gain and no bias: the same norm as "rms" with that gain
            norm.weight.copy_(gains.view(4, 1, 1).expand_as(norm.weight))
    q, k = captured_core_inputs(model, ids(2, 9))[0]
    d = model.config.head_dim
    for x in (q, k):  # RoPE rotates after the norm: ||x|| = g_h sqrt(d) (up to eps / mean(x^2), ~1e-5 here)
        assert torch.allclose(x.norm(dim=-1), (gains * math.sqrt(d)).view(1, 4, 1).expand(2, 4, 9), rtol=1e-4)


def test_affine_rms_treats_q_and_k_apart_and_starts_as_rms() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 5, 8) * 0.1
    rms, affine = QKNorm("rms", 3, 8), QKNorm("affine_rms", 3, 8)
    assert all(torch.equal(a, b) for a, b in zip(rms(q, k), affine(q, k)))  # at init: x / rms(x)
    with torch.no_grad():
        affine.bias[:, 1].fill_(1.0)  # k's bias only
    q2, k2 = affine(q, k)
    assert torch.equal(q2, rms(q, k)[0]) and torch.allclose(k2, rms(q, k)[1] + 1.0)
    # bf16 in, bf16 out, normalised in fp32
    qb, _ = rms(q.bfloat16(), k.bfloat16())
    assert qb.dtype == torch.bfloat16 and torch.allclose(qb.float().pow(2).mean(-1), torch.ones(2, 3, 5), rtol=2e-2)
    with pytest.raises(ValueError, match="kind: expected one of"):
        QKNorm("none", 3, 8)


@pytest.mark.parametrize("qk_norm", ["rms", "affine_rms"])
@pytest.mark.parametrize("overrides", [{}, {"softmax_window": 5}], ids=["plain", "window"])
def test_every_form_sees_the_same_normalised_q_and_k(qk_norm: str, overrides: dict) -> None:
    model = build(tiny_config(qk_norm=qk_norm, **overrides))
    with torch.no_grad():  # trained-looking values: per-head gains and biases
        for block in model.blocks:
            for p in block.attn.qk_norm.parameters():
                p.add_(0.3 * torch.randn_like(p))
    x = ids(2, 21)
    with torch.no_grad():
        chunked = model(x).logits
        cores = [getattr(b.attn.core, "core", b.attn.core) for b in model.blocks]
        for core in cores:
            core.form = "quadratic"
        quadratic = model(x).logits
        for core in cores:
            core.form = "chunked"
        state, steps = None, []
        for t in range(x.shape[1]):  # the recurrent decoding form, token by token
            out = model(x[:, t : t + 1], state=state, return_state=True)
            state, steps = out.state, steps + [out.logits]
    steps_bound = gpt_steps(model.config, x.shape[1])
    assert_close(quadratic, chunked, steps=steps_bound, name="quadratic vs chunked")
    assert_close(torch.cat(steps, dim=1), chunked, steps=steps_bound, name="recurrent vs chunked")


def test_off_by_default_adds_nothing_and_draws_nothing() -> None:
    fields = {k: v for k, v in tiny_config().to_dict().items() if k != "qk_norm"}
    assert ModelConfig(**fields).qk_norm == "none"
    plain = build(tiny_config())
    assert all(block.attn.qk_norm is None for block in plain.blocks)
    # the core receives exactly RoPE(q), RoPE(k) of the fused projection: no op in between
    x = ids(1, 7)
    attn = plain.blocks[0].attn
    (q, k), *_ = captured_core_inputs(plain, x)
    with torch.no_grad():
        hidden = plain.blocks[0].attn_norm(plain.embed(x))
        q0, k0, _ = attn.qkv(hidden).view(1, 7, 4, 3, 8).permute(3, 0, 2, 1, 4).unbind(0)
        q0, k0 = attn.rope(q0, k0, 0, None)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    # turned on, every other weight is the same draw (its init is deterministic): arms differ by the norm only
    for kind in ("rms", "affine_rms"):
        normed = build(tiny_config(qk_norm=kind)).state_dict()
        extra = {n for n in normed if ".qk_norm." in n}
        assert extra and normed.keys() - extra == plain.state_dict().keys()
        assert all(torch.equal(normed[n], t) for n, t in plain.state_dict().items())
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        tiny_config(qk_norm="l2")


@pytest.mark.parametrize("kind", ["rms", "affine_rms"])
def test_attention_contiguous_shards_hold_whole_heads_with_qk_norm(kind: str) -> None:
    from megaflex.model.gpt import Attention

    config, tp = tiny_config(qk_norm=kind), 2
    torch.manual_seed(0)
    full = Attention(config).eval()
    with torch.no_grad():
        for p in full.qk_norm.parameters():
            p.add_(0.3 * torch.randn_like(p))  # make the per-head layout observable
        x = torch.randn(2, 11, config.hidden_size)
        want, _ = full(x)
        got = sum(shard_attention(config, full, rank, tp).eval()(x)[0] for rank in range(tp))
    assert_close(got, want, steps=gpt_steps(config, 11) / config.num_layers)
