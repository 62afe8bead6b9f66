"""The fused trig feature map (``feature_maps/trig.py``) == its plain-autograd reference: features,
log-scale and gradients w.r.t. x and every parameter, paired (Flexformer-N) and unpaired
(Flexformer-S, Performer-trig), on odd shapes spanning several row blocks; fp64 gradcheck; bf16
inputs and autocast; the head thread pool; and the modules built on it."""

from __future__ import annotations

import pytest
import torch

from attention_helpers import make_map, map_steps
from megaflex.attention.feature_maps import trig as _trig
from megaflex.attention.feature_maps.trig import trig_feature_map, trig_feature_map_reference
from numerics import assert_close, fp32_steps_in

pytestmark = pytest.mark.numerics


@pytest.fixture
def small_blocks(monkeypatch):
    """64-row blocks, so short sequences already cross several block boundaries."""
    monkeypatch.setattr(_trig, "_BLOCK_ELEMENTS", 1)


def _inputs(paired: bool, n: int, dtype=torch.float32, seed: int = 0, batch: int = 2, heads: int = 3, d: int = 5):
    g = torch.Generator().manual_seed(seed)
    rows = 14 if paired else 7  # P: 2D = 14 (D = 7) or D = 7
    x = (torch.randn(batch, heads, n, d, generator=g, dtype=dtype) * 0.8).requires_grad_()
    omega = torch.randn(heads, rows, d, generator=g, dtype=dtype).requires_grad_()
    inv_t = (torch.rand(heads, generator=g, dtype=dtype) + 0.1).requires_grad_()
    return x, omega, inv_t


def _loss_probes(n: int, feat: int, dtype=torch.float32, batch: int = 2, heads: int = 3):
    g = torch.Generator().manual_seed(99)
    return torch.randn(batch, heads, n, feat, generator=g, dtype=dtype), torch.randn(batch, heads, n, generator=g, dtype=dtype)


def _grads(fn, x, omega, inv_t, paired: bool, use_log_scale: bool = True):
    features, log_scale = fn(x, omega, inv_t, paired=paired)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    p_feat, p_ls = _loss_probes(x.shape[2], features.shape[-1], dtype, batch=x.shape[0], heads=x.shape[1])
    loss = (features.to(p_feat.dtype) * p_feat).sum()
    if use_log_scale:
        loss = loss + (log_scale.to(p_ls.dtype) * p_ls).sum()
    leaves = [t for t in (x, omega, inv_t) if t.requires_grad]
    return features, log_scale, torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("n", [1, 63, 150])
@pytest.mark.parametrize("use_log_scale", [True, False])
def test_fused_matches_reference_fp32(small_blocks, paired, n, use_log_scale):
    x, omega, inv_t = _inputs(paired, n)
    feats, ls, grads = _grads(trig_feature_map, x, omega, inv_t, paired, use_log_scale)
    ref_feats, ref_ls, ref_grads = _grads(trig_feature_map_reference, x, omega, inv_t, paired, use_log_scale)
    assert feats.dtype == torch.float32 and feats.shape == (2, 3, n, 14)
    steps = map_steps(x, omega)
    assert_close(feats, ref_feats, steps=steps, name="features")
    assert_close(ls, ref_ls, steps=steps, name="log_scale")
    for name, a, b in zip(("x", "omega", "inv_temperature"), grads, ref_grads):
        if b is None:  # inv_temperature only reaches the loss through the log-scale
            assert a is None or not a.abs().any(), name
            continue
        assert a is not None, name
        assert_close(a, b, steps=steps, name=name)


@pytest.mark.parametrize("paired", [True, False])
def test_fused_gradcheck_fp64(small_blocks, paired):
    x, omega, inv_t = _inputs(paired, 70, dtype=torch.float64, batch=1, heads=2, d=3)
    assert torch.autograd.gradcheck(lambda *a: trig_feature_map(*a, paired=paired), (x, omega, inv_t))


def test_fused_partial_requires_grad(small_blocks):
    """Frozen frequencies (Performer buffers) and inputs without grad: only what is asked for."""
    x, omega, inv_t = _inputs(False, 90)
    omega, inv_t = omega.detach(), inv_t.detach()
    _, _, (gx,) = _grads(trig_feature_map, x, omega, inv_t, False)
    _, _, (ref_gx,) = _grads(trig_feature_map_reference, x, omega, inv_t, False)
    assert_close(gx, ref_gx, steps=map_steps(x, omega), name="x")
    x2, omega2, inv_t2 = _inputs(True, 90)
    _, _, (g_omega, g_inv) = _grads(trig_feature_map, x2.detach(), omega2, inv_t2, True)
    _, _, (r_omega, r_inv) = _grads(trig_feature_map_reference, x2.detach(), omega2, inv_t2, True)
    assert_close(g_omega, r_omega, steps=map_steps(x2, omega2), name="omega")
    assert_close(g_inv, r_inv, steps=map_steps(x2, omega2), name="inv_temperature")


@pytest.mark.parametrize("paired", [True, False])
def test_fused_bf16_input_and_autocast(small_blocks, paired):
    """bf16 x: features come back in bf16 (computed in fp32), log-scale fp32, grads in x's dtype;
    under bf16 autocast an fp32 x still gets fp32 maths (cos/sin of bf16 arguments would be noise)."""
    x, omega, inv_t = _inputs(paired, 130)
    xb = x.detach().bfloat16().requires_grad_()
    feats, ls, grads = _grads(trig_feature_map, xb, omega, inv_t, paired)
    ref_feats, ref_ls, ref_grads = _grads(trig_feature_map_reference, xb.detach().float().requires_grad_(), omega, inv_t, paired)
    assert feats.dtype == torch.bfloat16 and ls.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    steps = map_steps(x, omega)
    # bf16: the features round once, and the backward sees the bf16 features' gradient (one more
    # rounding) before and after its fp32 maths; the log-scale stays fp32 end to end
    bf16_steps = 3 + fp32_steps_in(torch.bfloat16, steps)
    assert_close(feats, ref_feats, steps=bf16_steps, dtype=torch.bfloat16, name="features")
    assert_close(ls, ref_ls, steps=steps, name="log_scale")
    for name, a, b in zip(("x", "omega", "inv_temperature"), grads, ref_grads):
        assert_close(a, b, steps=bf16_steps, dtype=torch.bfloat16, name=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats_ac, ls_ac, grads_ac = _grads(trig_feature_map, x, omega, inv_t, paired)
    ref_feats, ref_ls, ref_grads = _grads(trig_feature_map_reference, x, omega, inv_t, paired)
    assert feats_ac.dtype == torch.float32
    assert_close(feats_ac, ref_feats, steps=steps, name="autocast features")
    for name, a, b in zip(("x", "omega", "inv_temperature"), grads_ac, ref_grads):
        assert_close(a, b, steps=steps, name=f"autocast {name}")


def test_fused_thread_pool_is_bitwise_equal(small_blocks):
    x, omega, inv_t = _inputs(True, 200, heads=4)
    threads = torch.get_num_threads()
    results = []
    for count in (1, 2):
        torch.set_num_threads(count)
        try:
            feats, ls, grads = _grads(trig_feature_map, x, omega, inv_t, True)
        finally:
            torch.set_num_threads(threads)
        results.append((feats, ls, *grads))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.get_num_threads() == threads


def _module_reference(fmap, x):
    """The module's map recomputed in plain autograd from its parameters."""
    if hasattr(fmap, "omega1"):
        omega = torch.cat([fmap.omega1, fmap.omega2], dim=1)
        return trig_feature_map_reference(x, omega, torch.exp(-fmap.log_temperature()), paired=True)
    inv_t = torch.full((fmap.num_heads,), 1.0 / (2.0 * fmap.head_dim**0.5))
    return trig_feature_map_reference(x, fmap.omega, inv_t, paired=False)


@pytest.mark.parametrize("kind, kwargs", [("flexformer_n", {}), ("flexformer_s", {}), ("performer", {"variant": "trig"})])
def test_modules_match_reference_with_parameter_grads(small_blocks, kind, kwargs):
    fmap = make_map(kind, 3, 6, 12, **kwargs)
    if kind == "flexformer_n":  # tau near the floor: the soft-floor path is exercised too
        with torch.no_grad():
            fmap.tau.copy_(torch.tensor([fmap.min_log_temperature + 0.05, 1.0, fmap.min_log_temperature + 3.0]))
    x = (torch.randn(2, 3, 77, 6, generator=torch.Generator().manual_seed(4)) * 0.7).requires_grad_()
    params = [x, *fmap.parameters()]
    out = fmap(x)
    ref_feats, ref_ls = _module_reference(fmap, x)
    omega = torch.cat([fmap.omega1, fmap.omega2], dim=1) if hasattr(fmap, "omega1") else fmap.omega
    steps = map_steps(x, omega) + 4  # the temperature's soft floor and exp
    assert_close(out.features, ref_feats, steps=steps, name="features")
    assert_close(out.log_scale, ref_ls, steps=steps, name="log_scale")
    p_feat, p_ls = _loss_probes(77, 12)
    grads = torch.autograd.grad((out.features * p_feat).sum() + (out.log_scale * p_ls).sum(), params)
    ref_grads = torch.autograd.grad((ref_feats * p_feat).sum() + (ref_ls * p_ls).sum(), params)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, steps=steps)


def test_bad_shapes_raise():
    x = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match="omega"):
        trig_feature_map(x, torch.randn(2, 5, 3), torch.ones(2), paired=True)  # odd P for a paired map
    with pytest.raises(ValueError, match="omega"):
        trig_feature_map(x, torch.randn(3, 4, 3), torch.ones(2), paired=False)
    with pytest.raises(ValueError, match="inv_temperature"):
        trig_feature_map(x, torch.randn(2, 4, 3), torch.ones(3), paired=False)


@pytest.mark.parametrize("paired", [True, False])
def test_decode_path_without_grad_equals_fused(paired):
    """Few-token inference calls take the plain path; it must agree with the fused function."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 1, 8)
    omega = torch.randn(3, 6 if paired else 3, 8)
    inv_t = torch.rand(3)
    with torch.no_grad():
        small = _trig.trig_feature_map(x, omega, inv_t, paired=paired)
    fused = _trig._TrigFeatureMap.apply(x, omega, inv_t, paired)
    for a, b in zip(small, fused):
        assert_close(a, b.detach(), steps=map_steps(x, omega))


@pytest.fixture
def device_plan(monkeypatch):
    """The plan GPU tensors take, forced on CPU tensors, with 64-row blocks; records the rows
    (flattened batch x heads) of every ``trig_rows`` call and the item count of every pass."""
    monkeypatch.setattr(_trig, "_per_head_items", lambda device: False)
    monkeypatch.setattr(_trig, "_DEVICE_BLOCK_ELEMENTS", 1)
    record = {"rows": [], "items": []}
    trig_rows, for_each_head = _trig.trig_rows, _trig.for_each_head

    def counted_rows(xb, *args):
        record["rows"].append(xb.shape[0])
        return trig_rows(xb, *args)

    def counted_items(fn, count, device):
        record["items"].append(count)
        return for_each_head(fn, count, device)

    monkeypatch.setattr(_trig, "trig_rows", counted_rows)
    monkeypatch.setattr(_trig, "for_each_head", counted_items)
    return record


@pytest.mark.parametrize("paired", [True, False])
def test_device_plan_maps_every_batch_and_head_row_in_one_call(device_plan, paired):
    """Off CPU no Python loop runs over (batch, head): one item of all B x H rows per pass, one
    ``trig_rows`` call per block of tokens; features, log-scale and gradients equal the reference."""
    x, omega, inv_t = _inputs(paired, 150, batch=2, heads=3)
    feats, ls, grads = _grads(trig_feature_map, x, omega, inv_t, paired)
    ref_feats, ref_ls, ref_grads = _grads(trig_feature_map_reference, x, omega, inv_t, paired)
    assert device_plan["items"] == [1, 1]  # forward and backward: one item each
    assert device_plan["rows"] == [2 * 3] * 3  # 150 tokens in 64-row blocks, all six (b, h) rows per call
    steps = map_steps(x, omega)
    assert_close(feats, ref_feats, steps=steps, name="features")
    assert_close(ls, ref_ls, steps=steps, name="log_scale")
    for name, a, b in zip(("x", "omega", "inv_temperature"), grads, ref_grads):
        assert_close(a, b, steps=steps, name=name)
