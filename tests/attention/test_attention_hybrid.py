"""Quality closers (``megaflex.attention.hybrid``): naive references, form equality, decoding."""

from __future__ import annotations

import pytest
import torch

from megaflex.attention import AttentionCore, named_kernel_parameters
from megaflex.attention.hybrid import HybridState, LocalMixingCore
from megaflex.model import GPT, ModelConfig
from attention_helpers import AVAILABLE_FORMS, form_steps, make_qkv
from numerics import assert_close, gpt_steps, normwise_scale

pytestmark = pytest.mark.numerics

CLOSERS = [(5, 0), (0, 3), (5, 3)]  # (window, conv_size)
HEADS, D = 2, 8


def make_core(form: str, window: int, conv_size: int, seed: int = 0, mixing: str = "gated") -> LocalMixingCore:
    torch.manual_seed(seed)
    core = LocalMixingCore(
        AttentionCore("flexformer_n", HEADS, D, feature_dim=16, form=form, chunk_size=8), window=window, conv_size=conv_size,
        mixing=mixing,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if core.conv_weight is not None:  # leave the identity init: every tap must matter
            core.conv_weight.copy_(torch.randn(core.conv_weight.shape, generator=gen))
        if core.window_mix is not None:  # a different mix per head, not the even init
            core.window_mix.copy_(torch.randn(core.window_mix.shape, generator=gen))
    return core


def hybrid_steps(core: LocalMixingCore, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Error growth (tests/numerics.py): the linear core's, plus the window's softmax and the
    convolution's taps (their sums, forward and backward) and the gate's few elementwise steps."""
    window, conv = core.window or 0, core.conv_size or 0
    return form_steps(core.core.feature_map, q, k, v) + 2 * (window + q.shape[-1] + conv) + 8


def naive_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, d], weight [H, d, K] -> x'_t = sum_j weight[..., j] * x_{t-K+1+j}, one token at a time."""
    k = weight.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[2]):
        for j in range(k):
            s = t - k + 1 + j
            if s >= 0:
                out[:, :, t] += weight[:, :, j] * x[:, :, s]
    return out


def naive_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        lo = max(0, t - window + 1)
        scores = (q[:, :, t : t + 1] @ k[:, :, lo : t + 1].transpose(-1, -2)) * q.shape[-1] ** -0.5
        out[:, :, t] = (torch.softmax(scores, dim=-1) @ v[:, :, lo : t + 1]).squeeze(2)
    return out


@pytest.mark.parametrize("window,conv_size", CLOSERS)
def test_matches_naive_reference(window, conv_size):
    core = make_core("quadratic", window, conv_size)
    q, k, v = make_qkv(2, HEADS, 19, D, seed=3)
    with torch.no_grad():
        got, _ = core(q, k, v)
        if conv_size:
            w = core.conv_weight
            q, k, v = naive_conv(q, w[:, 0]), naive_conv(k, w[:, 1]), naive_conv(v, w[:, 2])
        want, _ = core.core(q, k, v)
        if window:
            local = naive_window(q, k, v, window)
            local = local / local.pow(2).mean(-1, keepdim=True).add(core.core.eps).sqrt()  # the core's "rms"
            mix = torch.sigmoid(core.window_mix)
            want = (1 - mix) * want + mix * local
    assert_close(got, want, steps=hybrid_steps(core, q, k, v))


def test_window_branch_rms_normalised_and_mix_learns():
    """At init both branches have unit RMS and weigh 1/2 each; the mix gets a gradient."""
    core = LocalMixingCore(AttentionCore("flexformer_n", HEADS, D, feature_dim=16, chunk_size=8), window=4, mixing="gated")
    q, k, v = make_qkv(2, HEADS, 13, D, seed=5)
    v = v * 0.05  # a small v: the local average is small, its normalised branch is not
    out, _ = core(q, k, v)
    lin, _ = core.core(q, k, v)
    local = (2 * out - lin).detach()  # mix = 1/2 at init
    torch.testing.assert_close(local.pow(2).mean(-1), torch.ones_like(local[..., 0]), atol=0.02, rtol=0)  # eps: ~0.6%
    out.square().sum().backward()
    assert core.window_mix.grad is not None and core.window_mix.grad.abs().min() > 0
    assert "window_mix" in [p.name for p in core.kernel_parameters()]


MIXINGS = ("gated", "shared_normaliser")


@pytest.mark.parametrize("mixing", MIXINGS)
@pytest.mark.parametrize("window,conv_size", CLOSERS)
def test_forms_agree_and_continue_from_a_state(window, conv_size, mixing):
    q, k, v = make_qkv(2, HEADS, 23, D, seed=4)  # 23 = odd, not a multiple of chunk 8 or the window
    outs = {}
    for form in AVAILABLE_FORMS:
        core = make_core(form, window, conv_size, mixing=mixing)
        full, _ = core(q, k, v)
        first, state = core(q[:, :, :10], k[:, :, :10], v[:, :, :10], return_state=True)
        second, _ = core(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], state=state, return_state=True)
        assert isinstance(state, HybridState) and state.offset == 10
        steps = hybrid_steps(core, q, k, v)
        assert_close(torch.cat([first, second], dim=2), full, steps=steps, name=form)
        outs[form] = full
    for form, out in outs.items():
        assert_close(out, outs["quadratic"], steps=steps, name=form)


@pytest.mark.parametrize("mixing", MIXINGS)
@pytest.mark.parametrize("window,conv_size", CLOSERS)
def test_gradients_agree_across_forms(window, conv_size, mixing):
    grads = {}
    for form in AVAILABLE_FORMS:
        core = make_core(form, window, conv_size, mixing=mixing)
        q, k, v = (t.requires_grad_() for t in make_qkv(1, HEADS, 13, D, seed=5))
        out, _ = core(q, k, v)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[form] = [q.grad, k.grad, v.grad] + [p.grad for p in core.parameters()]
    # parameters' gradients sum over every (batch, head, token) position
    steps = hybrid_steps(core, q, k, v) + 2 * q[..., 0].numel()
    terms = max(normwise_scale(g) for g in grads["quadratic"])  # rounding scales with the terms
    for form, g in grads.items():
        for a, b in zip(g, grads["quadratic"]):
            assert_close(a, b, steps=steps, floor=terms, name=form)


def model_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=97, num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, feature_dim=16,
                  chunk_size=8, max_seq_len=64, init_std=0.2, softmax_window=4, qkv_conv_size=3)
    return ModelConfig(**{**values, **overrides})


@pytest.mark.parametrize("mixing", MIXINGS)
@pytest.mark.parametrize("window,conv_size", CLOSERS)
def test_model_decoding_matches_the_full_forward(window, conv_size, mixing):
    torch.manual_seed(0)
    model = GPT(model_config(softmax_window=window, qkv_conv_size=conv_size, window_mixing=mixing)).eval()
    for block in model.blocks:  # conv taps away from the identity, as after training
        if block.attn.core.conv_weight is not None:
            with torch.no_grad():
                block.attn.core.conv_weight.add_(0.3 * torch.randn_like(block.attn.core.conv_weight))
    x = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x).logits
        prefix = model(x[:, :9], return_state=True)  # chunked prefix, then token by token
        state, steps = prefix.state, [prefix.logits]
        for t in range(9, 21):
            out = model(x[:, t : t + 1], state=state, return_state=True)
            state, steps = out.state, steps + [out.logits]
    assert full.std() > 0.3 and state.offset == 21
    assert_close(torch.cat(steps, dim=1), full, steps=gpt_steps(model.config, 21))


def test_conv_taps_are_declared_kernel_parameters_and_start_as_identity():
    torch.manual_seed(0)
    model = GPT(model_config())
    declared = dict(named_kernel_parameters(model))
    assert declared["blocks.0.attn.core.conv_weight"].role == "map_weight"
    assert "blocks.1.attn.core.core.feature_map.omega1" in declared
    assert set(declared) <= {n for n, _ in model.named_parameters()}
    core = make_core("quadratic", 0, 3)
    identity = LocalMixingCore(core.core, conv_size=3)
    q, k, v = make_qkv(1, HEADS, 7, D, seed=6)
    with torch.no_grad():
        # identity taps: the convolution adds three exact products (by 1 and 0) per element
        assert_close(identity(q, k, v)[0], core.core(q, k, v)[0], steps=3)


def test_bad_arguments_raise():
    core = AttentionCore("flexformer_n", HEADS, D, feature_dim=16)
    with pytest.raises(ValueError, match="window"):
        LocalMixingCore(core, window=-1)
    with pytest.raises(ValueError, match="both 0"):
        LocalMixingCore(core)
    with pytest.raises(ValueError, match="softmax"):
        LocalMixingCore(AttentionCore("softmax", HEADS, D), window=4, mixing="gated")
    with pytest.raises(ValueError, match="softmax"):
        LocalMixingCore(AttentionCore("softmax", HEADS, D), conv_size=3)
    with pytest.raises(ValueError, match="softmax_window"):
        model_config(attention="softmax", qkv_conv_size=0, window_mixing="gated")
    with pytest.raises(ValueError, match="qkv_conv_size"):
        model_config(attention="softmax", softmax_window=0)
    with pytest.raises(ValueError, match="mixing"):
        LocalMixingCore(core, window=4, mixing="blend")
    with pytest.raises(ValueError, match="window_mixing"):
        model_config(window_mixing="blend")
    with pytest.raises(ValueError, match="HybridState"):
        make_core("quadratic", 4, 0)(*make_qkv(1, HEADS, 3, D), state=object())


def test_reshard_layout_shards_conv_taps_window_mix_and_kernel_by_heads():
    from megaflex.checkpoint.reshard import gpt_layout

    layout = gpt_layout(model_config(window_mixing="gated"))
    assert layout["blocks.0.attn.core.conv_weight"].partition_dim == 0
    assert layout["blocks.0.attn.core.window_mix"].partition_dim == 0
    assert layout["blocks.1.attn.core.core.feature_map.tau"].partition_dim == 0


def test_distillation_weights_loss_refuses_hybrid_students():
    from megaflex.training.distill.losses import supports_attention_weights

    core = AttentionCore("flexformer_n", HEADS, D, feature_dim=16)
    assert supports_attention_weights(core) and supports_attention_weights(AttentionCore("softmax", HEADS, D))
    for mixing in MIXINGS:
        assert not supports_attention_weights(LocalMixingCore(core, window=4, mixing=mixing))
    assert not supports_attention_weights(LocalMixingCore(core, conv_size=3))


@pytest.mark.parametrize("mixing", MIXINGS)
def test_decoding_prompts_shorter_than_the_window_match_the_full_forward(mixing):
    """Every prompt length 1 .. W + 1, then the rest token by token and in chunks of 3: while the
    cache holds fewer than W - 1 keys, the gated window kept only some of them (logits off by up to 3.2 here)."""
    window, total = 8, 14
    torch.manual_seed(0)
    model = GPT(model_config(softmax_window=window, qkv_conv_size=0, window_mixing=mixing)).eval()
    x = torch.randint(0, 97, (2, total), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x).logits
        assert full.std() > 0.3
        for prompt in range(1, window + 2):
            for chunk in (1, 3):
                out = model(x[:, :prompt], return_state=True)
                state, logits = out.state, [out.logits]
                for t in range(prompt, total, chunk):
                    out = model(x[:, t : t + chunk], state=state, return_state=True)
                    state, logits = out.state, logits + [out.logits]
                assert state.offset == total
                assert_close(torch.cat(logits, dim=1), full, steps=gpt_steps(model.config, total),
                             name=f"prompt {prompt}, chunks of {chunk}")
