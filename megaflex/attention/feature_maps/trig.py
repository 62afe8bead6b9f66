"""Fused random-Fourier (trig) feature maps: one autograd.Function for Flexformer-N/-S and Performer-trig.

    proj          = x omega^T                                  x [B, H, N, d], omega [H, P, d]
    unpaired (P = D):   features = D^-1/2  [cos proj ; sin proj]
    paired   (P = 2D):  features = (4D)^-1/2 [cos p1 + cos p2 ; sin p1 + sin p2],  proj = [p1 ; p2]
    log_scale     = ||x||^2 * inv_temperature[h]                                 [B, H, N]

Why fused: with plain autograd the map costs about as much as the whole chunked attention,
because every elementwise step (cos, sin, the pair sums, the scale, their backward) is a full
pass over a [B, H, N, P] tensor in main memory, and autograd keeps each intermediate alive.
Here each head's tokens go through in row blocks with ~512 KiB temporaries (in L2): per token the
forward writes only the features (which the attention saves anyway: shared, not copied). The
backward of unpaired maps reads s [cos ; sin] back from the features; paired maps (whose features
are pair sums) recompute the projection and its cos/sin per block (one matmul and cos/sin)
rather than keep another [B, H, N, P] tensor alive for the backward.
Heads run on the shared head thread pool, like the chunked form; for short sequences whole batch
entries (all their heads) go through each call together, since per-call overhead would dominate.
On a GPU (one stream, no thread pool, per-launch overhead) all (batch, head) rows go through
each call together: a Python loop over them would launch B x H small kernels per block; only
the tokens are cut into blocks, to bound the transient [B H, rows, P] temporaries.

Backward (g = dL/dfeatures, split into gC, gS [.., D]; s = the feature scale):

    dproj_j = s (cos(proj_j) gS - sin(proj_j) gC)       (each half j of a paired map alike)
    dx      = dproj omega + 2 x (dL/dlog_scale) inv_temperature[h]
    domega  = sum_b dproj^T x,    dinv_temperature[h] = sum_{b, n} dL/dlog_scale ||x||^2

``trig_feature_map_reference`` is the same map in plain autograd: the ground truth for tests.
"""

from __future__ import annotations

import torch

from ..heads import for_each_head
from ..base import accumulation_dtype
from .common import fp32_region

# elements of one block temporary ([rows, P] fp32): 512 KiB, so a block's few temporaries fit in L2
_BLOCK_ELEMENTS = 1 << 17
# elements of a short-N item's [rows, tokens, P] temporaries (whole batch entries per call)
_SHORT_ELEMENTS = 1 << 19
# elements of one [B H, rows, P] fp32 temporary off CPU (128 MiB; three live at once)
_DEVICE_BLOCK_ELEMENTS = 1 << 25
# batch x tokens at or below which inference calls take the plain path (one decode step per sequence)
_DECODE_ROWS = 16


def _row_blocks(n: int, width: int) -> list[slice]:
    rows = max(64, _BLOCK_ELEMENTS // width)
    return [slice(r, min(r + rows, n)) for r in range(0, n, rows)]


def _per_head_items(device: torch.device) -> bool:
    """Whether ``device`` takes the blocked per-head plan (CPU: cache-sized blocks on a thread
    pool) rather than the vectorised one (every (batch, head) row in each call: GPUs)."""
    return device.type == "cpu"


def _work_plan(batch: int, heads: int, n: int, p: int, device: torch.device) -> tuple[list[slice], list[slice]]:
    """(items, row blocks): an item is a range of flattened (batch, head) rows taken by one call.

    Off CPU: one item of every row, tokens in blocks of about ``_DEVICE_BLOCK_ELEMENTS``.
    CPU, long N: one head per item, its tokens in cache-sized row blocks. Short N (a whole batch
    entry's heads fit ``_SHORT_ELEMENTS``): items of whole batch entries, all tokens at once, so
    per-call overhead is paid per item rather than per head (but at least one item per thread).
    """
    if not _per_head_items(device):
        rows = max(64, _DEVICE_BLOCK_ELEMENTS // (batch * heads * p))
        return [slice(0, batch * heads)], [slice(r, min(r + rows, n)) for r in range(0, n, rows)]
    per_entry = heads * n * p
    if per_entry > _SHORT_ELEMENTS:
        return [slice(i, i + 1) for i in range(batch * heads)], _row_blocks(n, p)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    entries = max(1, min(_SHORT_ELEMENTS // per_entry, -(-batch // threads)))
    return [slice(b * heads, min(b + entries, batch) * heads) for b in range(0, batch, entries)], [slice(0, n)]


def _per_item(t: torch.Tensor, item: slice, heads: int) -> torch.Tensor:
    """A per-head tensor t [H, ...] for an item's rows (b, h): t[h] for one head, else tiled per entry."""
    if item.stop - item.start == 1:
        h = item.start % heads
        return t[h : h + 1]
    return t.repeat((item.stop - item.start) // heads, *([1] * (t.dim() - 1)))


def feature_scale(proj_rows: int, paired: bool) -> float:
    """D^-1/2 (unpaired, D = P) or (4D)^-1/2 (paired, D = P / 2)."""
    return (2 * proj_rows) ** -0.5 if paired else proj_rows**-0.5


def _cos_sin(src: torch.Tensor, cos_out: torch.Tensor, sin_out: torch.Tensor) -> None:
    """cos and sin of a block into ``cos_out``, ``sin_out`` (same shape and dtype). ATen's
    vectorised fp32 cos/sin measured ~20% faster than NumPy's with torch 2.13 on this repo's CPU."""
    torch.cos(src, out=cos_out)
    torch.sin(src, out=sin_out)


def trig_rows(
    xb: torch.Tensor, w_t: torch.Tensor, paired: bool, proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    features: torch.Tensor, scale: float,
) -> None:  # fmt: skip
    """The map of a row block into ``features`` [n, R, 2D] times ``scale`` (the feature scale, or 1
    where a caller folds it elsewhere): xb [n, R, d], w_t = omega^T [n, d, P]; proj, cos, sin
    [n, R, P] are scratch, left holding the projection and its cos and sin."""
    p = proj.shape[-1]
    half = p // 2 if paired else p
    torch.bmm(xb, w_t, out=proj)
    _cos_sin(proj, cos, sin)
    if paired:
        torch.add(cos[..., :half], cos[..., half:], out=features[..., :half])
        torch.add(sin[..., :half], sin[..., half:], out=features[..., half:])
    else:
        features[..., :half] = cos
        features[..., half:] = sin
    if scale != 1.0:
        features.mul_(scale)


def trig_d_proj(
    cos: torch.Tensor, sin: torch.Tensor, g: torch.Tensor, paired: bool, out: torch.Tensor, scale: float
) -> torch.Tensor:  # fmt: skip
    """dL/dproj into ``out`` [n, R, P] from g = dL/dfeatures [n, R, 2D] of features scaled by
    ``scale`` (as in ``trig_rows``) and the projection's cos, sin [n, R, P]: each half j,
    dproj_j = scale (cos p_j g_sin - sin p_j g_cos)."""
    half = g.shape[-1] // 2
    pairs = (*cos.shape[:-1], 2 if paired else 1, half)  # [n, R, (p1, p2), D]
    torch.mul(cos.view(pairs), g[..., half:].unsqueeze(-2), out=out.view(pairs))
    out.view(pairs).addcmul_(sin.view(pairs), g[..., :half].unsqueeze(-2), value=-1.0)
    if scale != 1.0:
        out.mul_(scale)
    return out


class _TrigFeatureMap(torch.autograd.Function):
    """(x [B, H, N, d], omega [H, P, d], inv_temperature [H], paired) -> (features [B, H, N, 2D] in
    x.dtype, log_scale [B, H, N] in the accumulation dtype). See the module docstring."""

    @staticmethod
    def forward(ctx, x, omega, inv_temperature, paired):  # type: ignore[override]
        batch, heads, n, d = x.shape
        bh, p = batch * heads, omega.shape[1]
        acc = accumulation_dtype(x.dtype)
        half = p // 2 if paired else p  # D
        x32 = x.to(acc).reshape(bh, n, d).contiguous()  # [BH, N, d]
        w = omega.to(acc).contiguous()
        inv_t = inv_temperature.to(acc)
        features = x32.new_empty(bh, n, 2 * half)  # fp32 [s cos ; s sin] (pair sums when paired)
        log_scale = x32.new_empty(bh, n)
        items, blocks = _work_plan(batch, heads, n, p, x.device)

        def item_rows(j: int) -> None:
            it = items[j]
            w_t, inv_i = _per_item(w, it, heads).transpose(1, 2), _per_item(inv_t, it, heads).unsqueeze(-1)
            rows0, size = blocks[0].stop - blocks[0].start, it.stop - it.start
            proj, cos, sin = (x32.new_empty(size, rows0, p) for _ in range(3))
            for rows in blocks:
                r = rows.stop - rows.start
                xb, fb, pb, cb, sb = x32[it, rows], features[it, rows], proj[:, :r], cos[:, :r], sin[:, :r]
                trig_rows(xb, w_t, paired, pb, cb, sb, fb, feature_scale(p, paired))
                torch.mul((xb * xb).sum(dim=-1), inv_i, out=log_scale[it, rows])

        with fp32_region(x):
            for_each_head(item_rows, len(items), x.device)
        # unpaired features are s [cos ; sin]: all the backward needs. Paired ones are pair sums, so
        # the backward recomputes the projection's cos/sin instead of keeping [BH, N, P] more
        ctx.save_for_backward(x32, w, inv_t, None if paired else features)
        ctx.meta = (x.shape, x.dtype, omega.dtype, inv_temperature.dtype, paired)
        ctx.set_materialize_grads(False)  # the query's log_scale is unused: its gradient stays None
        out = features.view(batch, heads, n, 2 * half)
        return (out if out.dtype == x.dtype else out.to(x.dtype)), log_scale.view(batch, heads, n)

    @staticmethod
    def backward(ctx, d_features, d_log_scale):  # type: ignore[override]
        x32, w, inv_t, features = ctx.saved_tensors
        (batch, heads, n, d), x_dtype, omega_dtype, inv_dtype, paired = ctx.meta
        need_x, need_omega, need_inv = ctx.needs_input_grad[:3]
        bh, p = batch * heads, w.shape[1]
        half = p // 2 if paired else p
        acc = x32.dtype
        dx = x32.new_zeros(bh, n, d) if need_x else None
        d_omega = x32.new_zeros(bh, p, d) if need_omega and d_features is not None else None
        d_inv = x32.new_zeros(bh) if need_inv and d_log_scale is not None else None
        g_all = None if d_features is None else d_features.reshape(bh, n, 2 * half)
        ls_all = None if d_log_scale is None else d_log_scale.reshape(bh, n).to(acc)
        items, blocks = _work_plan(batch, heads, n, p, x32.device)

        def item_rows(j: int) -> None:
            it = items[j]
            w_i, inv_i = _per_item(w, it, heads), _per_item(inv_t, it, heads).unsqueeze(-1)
            rows0, size = blocks[0].stop - blocks[0].start, it.stop - it.start
            cos, sin, d_proj_buf = (x32.new_empty(size, rows0, p) for _ in range(3)) if paired else (None, None, None)
            for rows in blocks:
                xb = x32[it, rows]
                r = xb.shape[1]
                if g_all is not None and (dx is not None or d_omega is not None):
                    g = g_all[it, rows].to(acc)  # [items, R, 2D]
                    g_cos, g_sin = g[..., :half], g[..., half:]
                    if paired:
                        # each half j: dproj_j = s (cos p_j g_sin - sin p_j g_cos), p_j recomputed
                        cb, sb, d_proj = cos[:, :r], sin[:, :r], d_proj_buf[:, :r]
                        torch.bmm(xb, w_i.transpose(1, 2), out=d_proj)
                        _cos_sin(d_proj, cb, sb)
                        trig_d_proj(cb, sb, g, paired, d_proj, feature_scale(p, paired))
                    else:
                        fb = features[it, rows]  # s cos | s sin
                        d_proj = (fb[..., :half] * g_sin).addcmul_(fb[..., half:], g_cos, value=-1.0)
                    if dx is not None:
                        torch.bmm(d_proj, w_i, out=dx[it, rows])
                    if d_omega is not None:
                        d_omega[it].baddbmm_(d_proj.transpose(1, 2), xb)
                if ls_all is not None:
                    lsb = ls_all[it, rows]
                    if dx is not None:
                        dx[it, rows].addcmul_(xb, (lsb * (2 * inv_i)).unsqueeze(-1))
                    if d_inv is not None:
                        d_inv[it] += (lsb * (xb * xb).sum(dim=-1)).sum(dim=-1)

        with fp32_region(x32):
            for_each_head(item_rows, len(items), x32.device)
        d_x = None if dx is None else dx.view(batch, heads, n, d).to(x_dtype)
        if d_omega is not None:
            d_omega = d_omega.view(batch, heads, p, d).sum(dim=0).to(omega_dtype)
        if d_inv is not None:
            d_inv = d_inv.view(batch, heads).sum(dim=0).to(inv_dtype)
        return d_x, d_omega, d_inv, None


def trig_feature_map(
    x: torch.Tensor, omega: torch.Tensor, inv_temperature: torch.Tensor, *, paired: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused trig features and log-scale: x [B, H, N, d], omega [H, P, d], inv_temperature [H]
    -> (features [B, H, N, 2D] in x.dtype, log_scale [B, H, N] fp32; fp64 for fp64 x).

    ``paired``: omega stacks two frequency sets [O1 ; O2] (P = 2D) whose cos and sin are summed
    (Flexformer-N); otherwise P = D (Flexformer-S, Performer-trig). Differentiable w.r.t. x,
    omega and inv_temperature (first order).
    """
    if paired and omega.shape[1] % 2:
        raise ValueError(f"omega: paired maps need an even number of rows [O1 ; O2], got shape {tuple(omega.shape)}")
    if omega.dim() != 3 or omega.shape[0] != x.shape[1] or omega.shape[2] != x.shape[3]:
        raise ValueError(f"omega: expected shape [{x.shape[1]}, P, {x.shape[3]}] (heads, rows, head_dim of x), got {tuple(omega.shape)}")
    if inv_temperature.shape != (x.shape[1],):
        raise ValueError(f"inv_temperature: expected shape ({x.shape[1]},) (one per head), got {tuple(inv_temperature.shape)}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, omega, inv_temperature))
    if not needs_grad and x.shape[0] * x.shape[2] <= _DECODE_ROWS:
        # Decoding (a few tokens, no autograd): the blocked, threaded path is pure overhead here.
        return trig_feature_map_reference(x, omega, inv_temperature, paired=paired)
    return _TrigFeatureMap.apply(x, omega, inv_temperature, paired)


def trig_feature_map_reference(
    x: torch.Tensor, omega: torch.Tensor, inv_temperature: torch.Tensor, *, paired: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``trig_feature_map`` in plain autograd (every intermediate materialised): the test reference."""
    acc = accumulation_dtype(x.dtype)
    with fp32_region(x):
        x32 = x.to(acc)
        proj = torch.einsum("bhnd,hpd->bhnp", x32, omega.to(acc))
        cos, sin = torch.cos(proj), torch.sin(proj)
        if paired:
            half = proj.shape[-1] // 2
            cos, sin = cos[..., :half] + cos[..., half:], sin[..., :half] + sin[..., half:]
        features = torch.cat([cos, sin], dim=-1) * feature_scale(proj.shape[-1], paired)
        log_scale = (x32 * x32).sum(dim=-1) * inv_temperature.to(acc)[:, None]
    return features.to(x.dtype), log_scale
