"""The decay of the window hybrid's far field (``model.kernel_decay`` with ``softmax_window``): a far key
s <= t - W weighs gamma^(t - s - W) times its kernel weight, the window's softmax weights are not decayed
(``attention/decay.py``, folded into the window forms' qls / kls / far state by ``window.common.fold_decay``).

Every form of the one-normaliser hybrid (quadratic, recurrent, chunked; the padded-key blocks; long training
sequences in recomputed segments; decoding from a state token by token) equals the definition computed
in fp64 without a stabiliser, outputs and gradients (q, k, v, Omega, tau, the decay logit).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_helpers import attention_steps, log_scale_spread, make_qkv
from megaflex.attention import AttentionCore, NORMALIZATIONS
from megaflex.attention.normalize import normalize_output
from megaflex.attention.feature_maps.trig import trig_feature_map_reference
from megaflex.attention.hybrid import LocalMixingCore
from numerics import assert_close, normwise_scale

pytestmark = pytest.mark.numerics

HEADS, D, FEAT, N = 3, 8, 16, 41


def _hybrid(window: int, normalization: str, form: str = "chunked") -> LocalMixingCore:
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT, normalization=normalization, chunk_size=8, form=form,
                         decay="learned")  # fmt: skip
    with torch.no_grad():  # a fast, a middling and a slow head
        core.decay_logit.copy_(torch.tensor([0.5, 2.5, 7.0]))
    return LocalMixingCore(core, window=window)


def definition(hybrid: LocalMixingCore, q, k, v, key_valid=None) -> torch.Tensor:
    """fp64, no stabiliser: exp(q.k / sqrt d) for s in (t - W, t], phi~(q).phi~(k) gamma^(t - s - W) for s <= t - W;
    autograd reaches q, k, v and the hybrid's parameters (through fp64 copies of their values)."""
    core, window, n = hybrid.core, hybrid.window, q.shape[2]
    omega, inv_t, paired = core.feature_map.trig_spec()
    g = -torch.nn.functional.softplus(-core.decay_logit.double())

    def phi(x):  # phi~(x) = exp(log-scale) features
        features, log_scale = trig_feature_map_reference(x, omega.double(), inv_t.double(), paired=paired)
        return features * log_scale.exp().unsqueeze(-1)

    q, k, v = q.double(), k.double(), v.double()
    t, s = torch.arange(n)[:, None], torch.arange(n)[None, :]
    near, far = (s <= t) & (s > t - window), s <= t - window
    logits = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(D))
    kernel = (phi(q) @ phi(k).transpose(-1, -2)) * torch.exp((t - s - window).clamp(min=0) * g[:, None, None])
    if key_valid is not None:
        near, far = near & key_valid[:, None, None, :], far & key_valid[:, None, None, :]
    weights = torch.where(near, logits, 0.0) + torch.where(far, kernel, 0.0)
    return normalize_output(weights @ v, weights.sum(-1), core.normalization, core.eps)


def _grads(out, probe, leaves):
    return torch.autograd.grad((out * probe).sum(), leaves)


def _steps(hybrid, q, k, v) -> float:
    """The window's error growth (plain kernel + window logits) plus the fold (N |g| on the log-scales)."""
    fmap = hybrid.core.feature_map
    with torch.no_grad():
        spread = log_scale_spread(fmap(q).log_scale, fmap(k).log_scale) + 2 * q.shape[2] * hybrid.core.log_decay().abs().max().item()
        logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    return attention_steps(q.shape[2], FEAT, v.shape[-1], spread + 2 * logits, D) + 2 * q[0, 0].numel() + 8


def _assert_matches_definition(hybrid, run, q, k, v, key_valid=None, name="") -> None:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    probe = torch.randn(v.shape, generator=torch.Generator().manual_seed(5))
    names, leaves = ["q", "k", "v"], [q, k, v]
    for param_name, param in hybrid.named_parameters():
        names.append(param_name)
        leaves.append(param)
    got = run(q, k, v)
    want = definition(hybrid, q, k, v, key_valid)
    real = slice(None) if key_valid is None else key_valid[0]  # the compared rows: real queries
    steps = _steps(hybrid, q, k, v)
    assert_close(got[..., real, :], want[..., real, :].float(), steps=steps, name=f"{name} out")
    mask = torch.ones_like(probe) if key_valid is None else key_valid[:, None, :, None].float()
    got_grads, want_grads = _grads(got, probe * mask, leaves), _grads(want, probe * mask, leaves)
    # on the largest gradient's scale; the decay logit's sums (t - s - W) x its far keys' terms, times 1 - gamma
    terms = max(normwise_scale(w) for n, w in zip(names, want_grads) if "decay" not in n)
    lag = N * (1 - torch.sigmoid(hybrid.core.decay_logit)).max().item()
    for n, g, w in zip(names, got_grads, want_grads):
        assert_close(g, w.float(), steps=2 * steps, floor=terms * (lag if "decay" in n else 1), name=f"{name} grad of {n}")


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
@pytest.mark.parametrize("window", [1, 6])
def test_forms_equal_the_definition(form: str, window: int, normalization: str) -> None:
    hybrid = _hybrid(window, normalization, form)
    q, k, v = make_qkv(2, HEADS, N, D, seed=1)
    _assert_matches_definition(hybrid, lambda q, k, v: hybrid(q, k, v)[0], q, k, v, name=form)


def test_long_training_sequences_in_segments_equal_the_definition() -> None:
    """The recomputed segments (``_segmented``): the far state and cache carried between them, the decay's
    gradient through the states."""
    hybrid = _hybrid(6, "capped_denominator")
    hybrid.segment_tokens = 8  # 41 tokens: six segments
    q, k, v = make_qkv(2, HEADS, N, D, seed=2)
    _assert_matches_definition(hybrid, lambda q, k, v: hybrid(q, k, v)[0], q, k, v, name="segments")


def test_calls_continuing_a_state_equal_the_definition() -> None:
    """Prefill, single decoding steps, a longer call: each from the previous call's far state and cache."""
    hybrid = _hybrid(6, "capped_denominator")
    q, k, v = make_qkv(2, HEADS, N, D, seed=3)

    def run(q, k, v):
        pieces, state, lo = [], None, 0
        for hi in (4, 5, 6, 7, 30, N):
            out, state = hybrid(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], state=state, return_state=True)
            pieces.append(out)
            lo = hi
        return torch.cat(pieces, dim=2)

    _assert_matches_definition(hybrid, run, q, k, v, name="calls")


def test_padded_keys_equal_the_definition_over_real_keys() -> None:
    """Right padding (the torch-ops blocks serve padded keys): pads never set the far field's stabiliser,
    however far their folded log-scales climb."""
    hybrid = _hybrid(6, "capped_denominator")
    q, k, v = make_qkv(2, HEADS, N, D, seed=4)
    key_valid = torch.ones(2, N, dtype=torch.bool)
    key_valid[1, 30:] = False
    _assert_matches_definition(hybrid, lambda q, k, v: hybrid(q, k, v, key_mask=key_valid)[0], q, k, v, key_valid, "padded")
