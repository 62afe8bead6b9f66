"""The learned per-head decay of linear attention (``megaflex/attention/decay.py``, ``model.kernel_decay``).

The reference forms apply gamma^(t - s) natively (``linear/naive.py``: the explicit (t - s) matrix,
``linear/recurrent.py``: the state decays by gamma per token); the chunked forms fold it into the
key log-scales and the state. Checked here: the reference is the definition (fp64, no stabiliser);
every form equals it in outputs, states and every gradient, d/dgamma included, on odd lengths and chunk
sizes, with and without a carried state; decoding token by token equals the chunked form; 4,096 tokens
stay finite and within the fold's rounding; the module's parameter, its init and its refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_helpers import decay_steps, make_map, make_qkv
from megaflex.attention import AttentionCore, LinearAttentionState, NORMALIZATIONS, RefusedAttention, causal_linear_attention
from megaflex.attention import named_kernel_parameters
from megaflex.attention import decay
from megaflex.attention.decay import initial_decay_logits, log_decay_of
from megaflex.attention.diagnostics import causal_weights
from megaflex.attention.hybrid import build_attention
from megaflex.attention.linear import chunk
from megaflex.attention.linear.chunk_trig import trig_linear_attention_chunked
from megaflex.attention.linear.recurrent import recurrent_linear_attention
from numerics import assert_close, normwise_scale

pytestmark = pytest.mark.numerics

# log gamma per head: a fast head (half-life ~2 tokens), one near RetNet's fastest (1 - 2^-5), one slow
LOG_DECAY = (-0.35, math.log(1 - 2**-5), math.log(1 - 2**-11))


def _log_decay(heads: int = 3) -> torch.Tensor:
    return torch.tensor(LOG_DECAY[:heads]).requires_grad_()


def _prefix_state(fmap, log_decay, heads: int, n: int) -> LinearAttentionState:
    """A genuine decayed state (from a prefix of n tokens), kv / k_sum as leaves."""
    q, k, v = make_qkv(2, heads, n, 8, 6, seed=1)
    with torch.no_grad():
        _, state = _attend(fmap, q, k, v, log_decay.detach(), form="quadratic")
    return LinearAttentionState(state.kv.clone().requires_grad_(), state.k_sum.clone().requires_grad_(), state.log_max, n)


def _attend(fmap, q, k, v, log_decay, *, form, state=None, normalization="rms", chunk_size=16):
    offset = 0 if state is None else state.offset
    qm, km = fmap(q, offset), fmap(k, offset)
    return causal_linear_attention(qm.features, km.features, km.log_scale, v, form=form, normalization=normalization,
                                   chunk_size=chunk_size, initial_state=state, log_decay=log_decay)  # fmt: skip


def _outputs_and_grads(kind, form, normalization, n, with_state, chunk_size=16):
    heads = 3
    fmap = make_map(kind, heads, 8, 32)
    log_decay = _log_decay(heads)
    state = _prefix_state(fmap, log_decay, heads, 5) if with_state else None
    q, k, v = make_qkv(2, heads, n, 8, 6, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    out, new = _attend(fmap, q, k, v, log_decay, form=form, state=state, normalization=normalization, chunk_size=chunk_size)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    loss = (out * probe).sum() + new.kv.sum() * 1e-3 + new.k_sum.sum() * 1e-3
    leaves = {"q": q, "k": k, "v": v, "log_decay": log_decay, **{f"map.{n}": p for n, p in fmap.named_parameters()}}
    if state is not None:
        leaves.update({"state.kv": state.kv, "state.k_sum": state.k_sum})
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    steps = decay_steps(fmap, q, k, v, log_decay, 5 if with_state else 0) + 2 * (out[0, 0].numel() + 6 * 32)
    return out, new, grads, steps


def _assert_agree(got, ref, n: int) -> None:
    out, state, grads, steps = got
    ref_out, ref_state, ref_grads, _ = ref
    assert_close(out, ref_out, steps=steps, name="out")
    for name in ("kv", "k_sum", "log_max"):  # the fold rounds the stabiliser too: within its argument's rounding
        assert_close(getattr(state, name), getattr(ref_state, name), steps=steps, name=name)
    assert state.offset == ref_state.offset
    # gradients on the largest one's scale; d/dg sums (t - s) x the key log-scales' terms: N times theirs
    terms = max(normwise_scale(g) for name, g in ref_grads.items() if name != "log_decay")
    for name, want in ref_grads.items():
        floor = terms * (n + 5) if name == "log_decay" else terms
        assert_close(grads[name], want, steps=steps, floor=floor, name=f"grad of {name}")


def test_quadratic_reference_is_the_definition() -> None:
    """fp64, no stabiliser: w_ts = gamma^(t - s) (qf_t . kf_s) exp(kls_s), across a carried state (the
    prefix's keys decay on into the next call)."""
    fmap = make_map("flexformer_n", 3, 8, 16).double()
    log_decay = _log_decay().double()
    q, k, v = (t.double() for t in make_qkv(2, 3, 19, 8, 6, seed=4))
    qm, km = fmap(q), fmap(k)
    t = torch.arange(19, dtype=torch.float64)
    lag = (t[:, None] - t[None, :]).clamp(min=0)
    weights = (qm.features @ km.features.transpose(-1, -2)) * torch.exp(km.log_scale.unsqueeze(-2) + lag * log_decay[:, None, None])
    weights = weights.tril()
    exact = (weights @ v) / weights.sum(-1, keepdim=True)  # the ratio: no eps against the stabiliser's scale
    want = causal_linear_attention(qm.features, km.features, km.log_scale, v, form="quadratic", normalization="denominator",
                                   log_decay=log_decay)[0]  # fmt: skip
    assert torch.allclose(want, exact, rtol=1e-10, atol=1e-12)
    # split at 7: the state after the prefix carries its keys on, decaying
    a, state = _attend(fmap, q[:, :, :7], k[:, :, :7], v[:, :, :7], log_decay, form="quadratic", normalization="denominator")
    b, _ = _attend(fmap, q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], log_decay, form="quadratic", state=state,
                   normalization="denominator")  # fmt: skip
    assert torch.allclose(torch.cat([a, b], dim=2), exact, rtol=1e-10, atol=1e-12)


# (form, N, chunk size, fold segment): odd lengths and chunks; 16-token fold segments (3 of them at N = 45)
FORM_CASES = [("recurrent", 1, 16, None), ("recurrent", 45, 16, None), ("chunked", 1, 16, None),
              ("chunked", 45, 16, None), ("chunked", 45, 5, None), ("chunked", 45, 5, 16)]


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form,n,chunk_size,segment", FORM_CASES)
def test_forms_equal_the_quadratic_reference(form, n, chunk_size, segment, normalization, with_state, monkeypatch) -> None:
    ref = _outputs_and_grads("flexformer_n", "quadratic", normalization, n, with_state)
    if segment is not None:
        monkeypatch.setattr(decay, "FOLD_SEGMENT", segment)
    _assert_agree(_outputs_and_grads("flexformer_n", form, normalization, n, with_state, chunk_size), ref, n)


@pytest.mark.parametrize("kind", ["performer", "elu", "hedgehog", "cosformer", "flexformer_s"])
def test_other_maps_decay_alike(kind: str) -> None:
    ref = _outputs_and_grads(kind, "quadratic", "capped_denominator", 23, True)
    _assert_agree(_outputs_and_grads(kind, "chunked", "capped_denominator", 23, True, chunk_size=7), ref, 23)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_segments_with_a_carried_state_equal_one_shot(form: str) -> None:
    """Backprop across calls (truncated BPTT, the hybrid's segments): the state's decay reaches d/dgamma."""
    fmap = make_map("flexformer_n", 3, 8, 16)
    log_decay = _log_decay()
    q, k, v = make_qkv(2, 3, 40, 8, 6, seed=5)
    probe = torch.randn(2, 3, 40, 6, generator=torch.Generator().manual_seed(6))

    def run(cuts, form):
        pieces, state, lo = [], None, 0
        for hi in cuts:
            out, state = _attend(fmap, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], log_decay, form=form, state=state,
                                 normalization="capped_denominator", chunk_size=8)  # fmt: skip
            pieces.append(out)
            lo = hi
        loss = (torch.cat(pieces, dim=2) * probe).sum() + state.kv.sum() * 0.1
        return [loss, *torch.autograd.grad(loss, [log_decay, *fmap.parameters()])]

    want, got = run([40], "quadratic"), run([1, 14, 16, 33, 40], form)
    steps = decay_steps(fmap, q, k, v, log_decay) + 2 * (probe[0, 0].numel() + 5)
    terms = max(normwise_scale(g) for g in want[2:])
    assert_close(got[0], want[0], steps=steps, name="loss")
    for i, (g, w) in enumerate(zip(got[1:], want[1:])):
        assert_close(g, w, steps=steps, floor=terms * (40 if i == 0 else 1), name=f"gradient {i}")


def test_fused_cpu_trig_path_equals_the_reference(monkeypatch) -> None:
    """The CPU default for trig maps (``chunk_trig``: the map fused into the chunked form, the decay folded
    into its key log-scales, segment by segment), forced for several heads: outputs and gradients of q, k,
    v, Omega, tau, gamma and the carried state."""
    monkeypatch.setattr(chunk, "_HEAD_BLOCK_ELEMENTS", 1)  # one head per block: the fused path
    monkeypatch.setattr(decay, "FOLD_SEGMENT", 16)  # three fold segments, the state carried between them
    fmap = make_map("flexformer_n", 3, 8, 16)
    omega, inv_t, paired = fmap.trig_spec()
    log_decay = _log_decay()
    state = _prefix_state(fmap, log_decay, 3, 4)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, 37, 8, 6, seed=7))
    probe = torch.randn(2, 3, 37, 6, generator=torch.Generator().manual_seed(8))
    leaves = [q, k, v, log_decay, state.kv, state.k_sum, *fmap.parameters()]

    def grads(out, new):
        return torch.autograd.grad((out * probe).sum() + new.kv.sum() * 0.1, leaves)

    got = trig_linear_attention_chunked(q, k, v, omega, inv_t, paired=paired, normalization="capped_denominator",
                                        chunk_size=8, initial_state=state, log_decay=log_decay)  # fmt: skip
    want = _attend(fmap, q, k, v, log_decay, form="quadratic", state=state, normalization="capped_denominator")
    steps = decay_steps(fmap, q, k, v, log_decay, 4) + 2 * (probe[0, 0].numel() + 37 * 2)
    assert_close(got[0], want[0], steps=steps, name="out")
    assert_close(got[1].kv, want[1].kv, steps=steps, name="kv")
    got_grads, want_grads = grads(*got), grads(*want)
    terms = max(normwise_scale(g) for g in want_grads)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, steps=steps, floor=terms * (41 if i == 3 else 1), name=f"gradient {i}")


def test_decoding_token_by_token_equals_the_chunked_form() -> None:
    """AttentionCore(decay='learned'): a 9-token prefill, then one decoding step per token (the recurrent
    step, O(1) each), equals one chunked call over all tokens."""
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", 3, 8, feature_dim=16, normalization="capped_denominator", chunk_size=8,
                         decay="learned")  # fmt: skip
    with torch.no_grad():
        core.decay_logit.copy_(torch.tensor([0.5, 3.0, 8.0]))
        q, k, v = make_qkv(2, 3, 30, 8, seed=9)
        full, full_state = core(q, k, v, return_state=True)
        pieces = [core(q[:, :, :9], k[:, :, :9], v[:, :, :9], return_state=True)]
        for t in range(9, 30):
            pieces.append(core(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=pieces[-1][1], return_state=True))
    steps = decay_steps(core.feature_map, q, k, v, core.log_decay())
    assert_close(torch.cat([out for out, _ in pieces], dim=2), full, steps=steps, name="out")
    assert_close(pieces[-1][1].kv, full_state.kv, steps=steps, name="kv")
    assert pieces[-1][1].offset == 30


def test_4096_tokens_stay_finite_and_within_the_fold_rounding() -> None:
    """Large key norms (log-scales up to ~200) and decays from gamma = e^-2 to 1 - 2^-12 over 4,096 tokens
    (two fold segments, folded key log-scales up to ~2,000): the chunked form is finite, forward and
    backward, and within its rounding bound of the native recurrent form in fp64."""
    torch.manual_seed(0)
    fmap = make_map("flexformer_n", 3, 8, 16)
    log_decay = torch.tensor([-2.0, math.log(1 - 2**-5), math.log(1 - 2**-12)], requires_grad=True)
    q, k, v = make_qkv(1, 3, 4096, 8, 4, seed=10, scale=2.0)
    k = (k * 3).requires_grad_()  # ||k||^2 / e^tau in the hundreds
    qm, km = fmap(q), fmap(k)
    out, state = causal_linear_attention(qm.features, km.features, km.log_scale, v, form="chunked",
                                         normalization="capped_denominator", log_decay=log_decay)  # fmt: skip
    grads = torch.autograd.grad((out * v).sum() + state.kv.sum(), [k, log_decay])
    assert all(torch.isfinite(t).all() for t in (out, state.kv, state.k_sum, *grads))
    with torch.no_grad():
        exact, exact_state = recurrent_linear_attention(
            qm.features.double(), km.features.double(), km.log_scale.double(), v.double(),
            normalization="capped_denominator", log_decay=log_decay.double(),
        )  # fmt: skip
    steps = decay_steps(fmap, q, k, v, log_decay)
    assert_close(out, exact, steps=steps, name="out")  # ~1.5e-3: the key log-scales' conditioning, not the fold
    assert_close(state.kv, exact_state.kv, steps=steps, name="kv")


def test_core_parameter_init_and_optimisation_role() -> None:
    core = AttentionCore("flexformer_n", 8, 8, feature_dim=16, decay="learned")
    gamma = torch.sigmoid(core.decay_logit.double())
    # RetNet's spectrum over the heads: 1 - gamma from 2^-5 to 2^-12, evenly in log
    assert torch.allclose(-torch.log2(1 - gamma), torch.linspace(5, 12, 8, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(core.log_decay().double(), torch.log(gamma), atol=1e-7)
    assert [(name, kp.role) for name, kp in named_kernel_parameters(core) if "decay" in name] == [("decay_logit", "temperature")]
    assert initial_decay_logits(1).shape == (1,) and torch.sigmoid(initial_decay_logits(1)).item() == pytest.approx(1 - 2**-5)
    assert log_decay_of(torch.tensor([100.0])).item() < 0  # gamma < 1 always: every exponent stays <= 0
    plain = AttentionCore("flexformer_n", 8, 8, feature_dim=16)
    assert plain.log_decay() is None and "decay_logit" not in dict(plain.named_parameters())


def test_refusals_name_the_setting() -> None:
    with pytest.raises(ValueError, match="kernel_decay: expected 'none' for attention kind 'softmax'"):
        AttentionCore("softmax", 2, 8, decay="learned")
    with pytest.raises(ValueError, match=r"kernel_decay: expected one of \('none', 'learned'\), got 'fixed'"):
        AttentionCore("elu", 2, 8, decay="fixed")
    encoder = AttentionCore("flexformer_n", 2, 8, feature_dim=16, decay="learned", causal=False)
    with pytest.raises(RefusedAttention, match="kernel_decay: .* set kernel_decay='none'"):
        build_attention(encoder)  # at build time, before any call
    with pytest.raises(RefusedAttention, match="kernel_decay"):
        x = torch.randn(1, 2, 4, 8)
        encoder(x, x, x)


def test_diagnostics_weigh_keys_by_their_decay() -> None:
    """The kernel statistics' causal weights of a decaying core are its weights: gamma^(t - s) times the plain ones."""
    fmap = make_map("flexformer_n", 3, 8, 16)
    log_decay = _log_decay().detach()
    q, k, _ = make_qkv(1, 3, 12, 8, seed=11)
    plain, decayed = causal_weights(q, k, fmap), causal_weights(q, k, fmap, log_decay)
    t = torch.arange(12)
    ratio = torch.exp((t[:, None] - t[None, :]).clamp(min=0) * log_decay[:, None, None]).tril()
    # each row up to its own positive scale (the stabiliser)
    rows = (decayed * plain * ratio).sum(-1) / (plain * ratio).pow(2).sum(-1)
    assert torch.allclose(decayed, plain * ratio * rows.unsqueeze(-1), rtol=1e-5, atol=1e-7)


def test_fla_mapping_with_decay_equals_the_reference(monkeypatch) -> None:
    """The fla backend's mapping (``gla_linear_attention``, the kernel replaced by a plain scan with
    chunk_simple_gla's semantics) with the decay folded in, over three fold segments: outputs, state and
    gradients, d/dgamma included."""
    from megaflex.attention.linear.chunk_fla import gla_linear_attention

    def scan(q, k, v, g, scale, initial_state, output_final_state):  # [B, T, H, *]: S_t = e^{g_t} S_{t-1} + k_t v_t^T
        s, outs = initial_state, []
        for t in range(q.shape[1]):
            s = s * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], s))
        return torch.stack(outs, dim=1), s

    monkeypatch.setattr(decay, "FOLD_SEGMENT", 16)
    fmap = make_map("flexformer_n", 3, 8, 16)
    log_decay = _log_decay()
    state = _prefix_state(fmap, log_decay, 3, 4)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, 37, 8, 6, seed=12))
    probe = torch.randn(2, 3, 37, 6, generator=torch.Generator().manual_seed(13))
    leaves = [q, k, v, log_decay, state.kv, state.k_sum]
    qm, km = fmap(q, 4), fmap(k, 4)
    results = []
    for fn, extra in ((causal_linear_attention, {"form": "quadratic"}), (gla_linear_attention, {"gla_fn": scan})):
        out, new = fn(qm.features, km.features, km.log_scale, v, normalization="capped_denominator", initial_state=state,
                      log_decay=log_decay, **extra)  # fmt: skip
        results.append((out, new.kv, torch.autograd.grad((out * probe).sum() + new.kv.sum() * 0.1, leaves, retain_graph=True)))
    (want, want_kv, want_grads), (got, got_kv, got_grads) = results
    steps = decay_steps(fmap, q, k, v, log_decay, 4) + 2 * probe[0, 0].numel()
    assert_close(got, want, steps=steps, name="out")
    assert_close(got_kv, want_kv, steps=steps, name="kv")
    terms = max(normwise_scale(g) for g in want_grads)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, steps=steps, floor=terms * (41 if i == 3 else 1), name=f"gradient {i}")


@pytest.mark.parametrize("return_state", [False, True])
def test_packed_documents_decay_each_from_its_start(return_state: bool) -> None:
    """Packed documents (batched in training, one call each with a state): each document is the decayed
    attention of its own tokens alone, whatever the row around it."""
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", 3, 8, feature_dim=16, normalization="capped_denominator", chunk_size=8,
                         decay="learned")  # fmt: skip
    with torch.no_grad():
        core.decay_logit.copy_(torch.tensor([0.5, 3.0, 8.0]))
    q, k, v = make_qkv(2, 3, 30, 8, seed=14)
    starts = torch.zeros(2, 30, dtype=torch.bool)
    starts[0, 11] = starts[0, 19] = starts[1, 4] = True
    out, _ = core(q, k, v, document_starts=starts, return_state=return_state)
    for row, bounds in ((0, (0, 11, 19, 30)), (1, (0, 4, 30))):
        for lo, hi in zip(bounds, bounds[1:]):
            alone, _ = core(q[row : row + 1, :, lo:hi], k[row : row + 1, :, lo:hi], v[row : row + 1, :, lo:hi])
            steps = decay_steps(core.feature_map, q, k, v, core.log_decay())
            assert_close(out[row : row + 1, :, lo:hi], alone, steps=steps, name=f"row {row} tokens {lo}..{hi}")
