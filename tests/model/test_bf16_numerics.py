"""bf16 that stays honest (issue 20, finding 3): a module cast to bf16 (as DeepSpeed casts the
model) still uses Omega, tau, the hybrid window mix and the RoPE frequencies in fp32 in its
forward, so only the inputs' own bf16 rounding remains."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from megaflex.attention import AttentionCore
from megaflex.attention.normalize import normalize_output
from megaflex.attention.feature_maps.flexformer_n import FlexformerNFeatureMap
from megaflex.attention.hybrid import LocalMixingCore
from megaflex.model import GPT, ModelConfig
from megaflex.model.cross_entropy import blockwise_cross_entropy
from megaflex.model.rope import RotaryEmbedding

HEADS, D = 4, 16


def _exact_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return torch.tensor([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64).float()


def test_rope_frequencies_stay_exact_under_a_bf16_cast() -> None:
    rope = RotaryEmbedding(64).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, _exact_inv_freq(64))
    assert not torch.equal(rope.inv_freq.bfloat16().float(), rope.inv_freq)  # a bf16 copy would differ
    q, k = (torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (0, 1))
    got = rope(q, k, offset=1000)
    want = RotaryEmbedding(64)(q, k, offset=1000)  # an fp32 module on the same bf16 inputs
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    model = GPT(ModelConfig(vocab_size=64, num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                            max_seq_len=32)).to(torch.bfloat16)
    assert all(torch.equal(b.attn.rope.inv_freq, _exact_inv_freq(16)) for b in model.blocks)


def test_flexformer_n_temperature_and_projection_in_fp32_with_bf16_parameters() -> None:
    torch.manual_seed(0)
    fm = FlexformerNFeatureMap(HEADS, D, 32)
    with torch.no_grad():
        fm.tau.copy_(torch.linspace(2.70, 2.80, HEADS))  # near log(2 sqrt 16) = 2.08 + margin, not bf16-exact
    cast = copy.deepcopy(fm).to(torch.bfloat16)
    # The fp32 reference holds exactly the values the bf16 module stores.
    ref = copy.deepcopy(fm)
    with torch.no_grad():
        for p_ref, p_cast in zip(ref.parameters(), cast.parameters()):
            p_ref.copy_(p_cast.float())
    tau_eff = cast.log_temperature()
    assert tau_eff.dtype == torch.float32 and torch.equal(tau_eff, ref.log_temperature())  # exactly the fp32 value
    assert torch.equal(tau_eff, cast.tau.float())  # above the floor: tau itself, no bf16 arithmetic on it
    x = torch.randn(2, HEADS, 24, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    got, want = cast(x), ref(x.float())
    assert got.log_scale.dtype == torch.float32
    assert torch.equal(got.log_scale, want.log_scale)  # the scale: fp32 end to end
    assert got.features.dtype == torch.bfloat16 and torch.equal(got.features, want.features.bfloat16())
    # what bf16 arithmetic on tau would have given: the temperature off by up to 1/128
    assert (torch.exp(-cast.tau).float() - torch.exp(-tau_eff)).abs().max() > 1e-4


def test_window_mix_in_fp32_with_bf16_parameters() -> None:
    torch.manual_seed(0)
    core = LocalMixingCore(AttentionCore("flexformer_n", HEADS, D, feature_dim=16, chunk_size=8), window=4, mixing="gated")
    with torch.no_grad():
        core.window_mix.copy_(torch.tensor([0.01, -0.02, 0.3, 1.7]).view(HEADS, 1, 1))
    core = core.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, 16, D, generator=g).mul(scale).bfloat16() for scale in (0.5, 0.5, 1.0))
    out, _ = core(q, k, v)
    linear, _ = core.core(q, k, v)
    local, _, _ = core._window_attention(q, k, v, None)
    if core.core.normalization == "rms":
        local = normalize_output(local, None, "rms", core.core.eps)
    mix = torch.sigmoid(core.window_mix.float())
    assert torch.equal(out, torch.lerp(linear.float(), local.float(), mix).bfloat16())
    bf16_mix = torch.lerp(linear, local.to(linear.dtype), torch.sigmoid(core.window_mix))
    assert not torch.equal(out, bf16_mix)  # the bf16 mix (steps of 1/256 near 1/2) is measurably different
    assert math.isclose(mix.view(-1)[0].item(), 1 / (1 + math.exp(-0.010009765625)), rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_blockwise_cross_entropy_equals_the_full_fp32_copy(dtype: torch.dtype, label_smoothing: float) -> None:
    g = torch.Generator().manual_seed(0)
    padded = (3 * torch.randn(2, 13, 40, generator=g)).to(dtype)  # 37 real classes + padding columns
    labels = torch.randint(0, 37, (2, 13), generator=g)
    mine = padded.clone().requires_grad_(True)
    ref = padded.clone().requires_grad_(True)
    weights = torch.rand(2, 13, generator=g)
    got = blockwise_cross_entropy(mine[..., :37], labels, label_smoothing, block_rows=5)  # 26 rows: 6 blocks
    want = F.cross_entropy(ref[..., :37].float().reshape(-1, 37), labels.reshape(-1), reduction="none",
                           label_smoothing=label_smoothing).view(2, 13)
    assert got.dtype == torch.float32 and torch.equal(got, want)  # per row the same fp32 computation
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert mine.grad.dtype == dtype and torch.equal(mine.grad[..., 37:], torch.zeros_like(mine.grad[..., 37:]))
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), atol=tol, rtol=tol)
