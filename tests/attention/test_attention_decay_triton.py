"""The decay of old keys (``attention/decay.py``) in the Triton forms, under Triton's interpreter (fp32, small
shapes): the kernels are unchanged, the decay is folded into their key log-scales and states, segment by
segment. The features path, the fused trig path (features in the kernels; and its unfused reference) and the
window hybrid's kernels equal the native quadratic reference / the torch backend, outputs and gradients
(d/dgamma included), with a carried state and three fold segments."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from attention_helpers import decay_steps, make_map, make_qkv  # noqa: E402
from megaflex.attention import AttentionCore, LinearAttentionState, causal_linear_attention, decay  # noqa: E402
from megaflex.attention.hybrid import LocalMixingCore  # noqa: E402
from megaflex.attention.triton import trig_linear_attention, triton_linear_attention  # noqa: E402
from numerics import assert_close, normwise_scale  # noqa: E402
from test_attention_decay import _log_decay  # noqa: E402

pytestmark = pytest.mark.numerics

N, CHUNK = 35, 16


@pytest.fixture(autouse=True)
def _three_fold_segments(monkeypatch):
    monkeypatch.setattr(decay, "FOLD_SEGMENT", 16)


def _compare(run, fmap, q, k, v, log_decay, state, name: str) -> None:
    """``run(state)`` -> (out, state) against the native quadratic form: outputs, kv and the gradients of
    q, k, v, the decay, the carried state and the map's parameters."""
    probe = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
    leaves = [q, k, v, log_decay, state.kv, state.k_sum, *fmap.parameters()]

    def result(out, new):
        loss = (out * probe).sum() + (new.kv * 0.1).sum()
        return out, new.kv, torch.autograd.grad(loss, leaves)

    qm, km = fmap(q, state.offset), fmap(k, state.offset)
    want = result(*causal_linear_attention(qm.features, km.features, km.log_scale, v, form="quadratic",
                                           normalization="capped_denominator", initial_state=state, log_decay=log_decay))
    got = result(*run(state))
    # fp32 kernels (3xTF32 where a state enters a product, as on the GPU): the same rounding bound
    steps = decay_steps(fmap, q, k, v, log_decay, state.offset) + 2 * (probe[0, 0].numel() + N)
    assert_close(got[0], want[0], steps=steps, name=f"{name} out")
    assert_close(got[1], want[1], steps=steps, name=f"{name} kv")
    terms = max(normwise_scale(g) for g in want[2])
    for i, (g, w) in enumerate(zip(got[2], want[2])):
        assert_close(g, w, steps=steps, floor=terms * (N if i == 3 else 1), name=f"{name} gradient {i}")


def _setup():
    fmap = make_map("flexformer_n", 2, 16, 32)
    log_decay = _log_decay(2)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, N, 16, 8, seed=2))
    return fmap, log_decay, q, k, v


def _state(fmap, log_decay) -> LinearAttentionState:
    """A decayed state after 5 tokens, kv / k_sum as leaves."""
    q, k, v = make_qkv(1, 2, 5, 16, 8, seed=3)
    with torch.no_grad():
        qm, km = fmap(q), fmap(k)
        _, s = causal_linear_attention(qm.features, km.features, km.log_scale, v, form="quadratic", log_decay=log_decay.detach())
    return LinearAttentionState(s.kv.clone().requires_grad_(), s.k_sum.clone().requires_grad_(), s.log_max, 5)


def test_triton_features_path_with_decay() -> None:
    fmap, log_decay, q, k, v = _setup()
    state = _state(fmap, log_decay)

    def run(state):
        qm, km = fmap(q, state.offset), fmap(k, state.offset)
        return triton_linear_attention(qm.features, km.features, km.log_scale, v, normalization="capped_denominator",
                                       chunk_size=CHUNK, initial_state=state, log_decay=log_decay)  # fmt: skip

    _compare(run, fmap, q, k, v, log_decay, state, "features")


@pytest.mark.parametrize("fused_map", [True, False])
def test_triton_trig_path_with_decay(fused_map: bool) -> None:
    fmap, log_decay, q, k, v = _setup()
    state = _state(fmap, log_decay)
    omega, inv_t, paired = fmap.trig_spec()

    def run(state):
        return trig_linear_attention(q, k, v, omega, inv_t, paired=paired, normalization="capped_denominator",
                                     chunk_size=CHUNK, initial_state=state, fused_map=fused_map, log_decay=log_decay)

    _compare(run, fmap, q, k, v, log_decay, state, f"trig fused={fused_map}")


def test_window_hybrid_on_triton_equals_the_torch_backend() -> None:
    """The hybrid's Triton window kernels take the folded qls / kls / far state like the torch Function."""
    q, k, v = make_qkv(1, 2, N, 16, seed=4)
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        core = AttentionCore("flexformer_n", 2, 16, feature_dim=32, normalization="capped_denominator", chunk_size=CHUNK,
                             backend=backend, decay="learned")  # fmt: skip
        with torch.no_grad():
            core.decay_logit.copy_(torch.tensor([0.5, 4.0]))
        hybrid = LocalMixingCore(core, window=6)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = hybrid(*leaves)
        grads = torch.autograd.grad((out * v).sum(), [*leaves, *hybrid.parameters()])
        results[backend] = (out, grads)
    logits = (q @ k.transpose(-1, -2)).abs().max().item() / 4  # the window's exp arguments q.k / sqrt d
    steps = decay_steps(core.feature_map, q, k, v, core.log_decay()) + 2 * 3 * 2 * logits + 2 * 6
    assert_close(results["triton"][0], results["torch"][0], steps=steps, name="out")
    terms = max(normwise_scale(g) for g in results["torch"][1])
    for i, (g, w) in enumerate(zip(results["triton"][1], results["torch"][1])):
        assert_close(g, w, steps=2 * steps, floor=terms * (N if i == 6 else 1), name=f"gradient {i}")
