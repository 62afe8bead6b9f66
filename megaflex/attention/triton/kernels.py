"""Triton kernels of chunked causal linear attention (the maths of ``core.py``; glue: ``function.py``).

Layout: every tensor is contiguous [BH, N, *] (batch x heads flattened); inputs in any float
dtype are cast to fp32 right after ``tl.load`` (the interpreter mishandles bf16 otherwise, and
the state must accumulate in fp32 anyway). Chunk c holds tokens [c C, (c + 1) C); ``MB`` [BH,
NC + 1] holds the chunk stabilisers: MB[:, 0] = the carried state's log_max, MB[:, c + 1] = m at
the last token of chunk c. ``M`` [BH, N] is the per-token running max m_t. Every exponent is
<= 0. States: ``S`` [F, Dv] (kv) and ``Z`` [F] (k_sum), relative to their chunk's stabiliser.

Kernels (four launches forward + backward, none loops in Python over heads, batch or chunks):

* ``chunk_states``:  sequential over chunks, parallel over (BH, Dv blocks): the state entering
  every chunk, and the final state. (Backward recomputes them: nothing but the inputs is saved.)
* ``chunk_outputs``: parallel over (chunks, BH): intra-chunk C x C block + carried state, then
  the normalisation. With ``BACKWARD`` it instead turns the output gradient into dn, dd
  (gradients of the numerator and denominator), recomputing n and d.
* ``chunk_state_grads``: reverse scan over chunks: dL/dS after every chunk, and of the initial state.
* ``chunk_grads``:   parallel over (chunks, BH): dq, dk, dv, dkls of one chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(ptr, rows, row_mask, cols, col_mask, stride):
    """fp32 [len(rows), len(cols)] tile of a row-major matrix (zeros outside the masks)."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def chunk_states(
    K, V, LS, MB, S0, Z0, STATES, ZS, SF, ZF,
    N, F, DV, NC,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0)
    pv = tl.program_id(1)
    f = tl.arange(0, BF)
    cols = pv * BV + tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    zm = fm & ((f * 0 + pv) == 0)  # k_sum is written by the first Dv block only
    t = tl.arange(0, CHUNK)
    state_off = f[:, None] * DV + cols[None, :]
    s = tl.load(S0 + bh * F * DV + state_off, mask=fm[:, None] & vm[None, :], other=0.0).to(tl.float32)
    z = tl.load(Z0 + bh * F + f, mask=fm, other=0.0).to(tl.float32)
    for c in range(NC):
        tl.store(STATES + (bh * NC + c) * F * DV + state_off, s, mask=fm[:, None] & vm[None, :])
        tl.store(ZS + (bh * NC + c) * F + f, z, mask=zm)
        m_prev = tl.load(MB + bh * (NC + 1) + c)
        m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
        tok = c * CHUNK + t
        tm = tok < N
        k = _tile(K + bh * N * F, tok, tm, f, fm, F)
        v = _tile(V + bh * N * DV, tok, tm, cols, vm, DV)
        ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
        kw = k * tl.where(tm, tl.exp(ls - m_cur), 0.0)[:, None]
        decay = tl.exp(m_prev - m_cur)
        s = s * decay + tl.dot(tl.trans(kw), v, input_precision=PREC)
        z = z * decay + tl.sum(kw, axis=0)
    tl.store(SF + bh * F * DV + state_off, s, mask=fm[:, None] & vm[None, :])
    tl.store(ZF + bh * F + f, z, mask=zm)


@triton.jit
def chunk_outputs(
    Q, K, V, LS, M, MB, STATES, ZS, OUT, G, DN, DD,
    N, F, DV, NC, eps,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    RMS: tl.constexpr, BACKWARD: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    f = tl.arange(0, BF)
    cols = tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    t = tl.arange(0, CHUNK)
    tok = c * CHUNK + t
    tm = tok < N
    q = _tile(Q + bh * N * F, tok, tm, f, fm, F)
    k = _tile(K + bh * N * F, tok, tm, f, fm, F)
    v = _tile(V + bh * N * DV, tok, tm, cols, vm, DV)
    s = _tile(STATES + (bh * NC + c) * F * DV, f, fm, cols, vm, DV)
    z = tl.load(ZS + (bh * NC + c) * F + f, mask=fm, other=0.0)
    ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
    m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
    m_prev = tl.load(MB + bh * (NC + 1) + c)
    causal = (t[None, :] <= t[:, None]) & tm[None, :]
    # exponent masked to -inf before exp: a later key may have a larger log-scale than m_t
    w = tl.dot(q, tl.trans(k), input_precision=PREC) * tl.exp(tl.where(causal, ls[None, :] - m[:, None], float("-inf")))
    carry = tl.exp(m_prev - m)
    n = tl.dot(w, v, input_precision=PREC) + carry[:, None] * tl.dot(q, s, input_precision=PREC)
    d = tl.sum(w, axis=1) + carry * tl.sum(q * z[None, :], axis=1)
    out_mask = tm[:, None] & vm[None, :]
    out_off = bh * N * DV + tok[:, None] * DV + cols[None, :]
    if RMS:
        r = 1.0 / tl.sqrt(tl.sum(n * n, axis=1) / DV + eps)
        o = n * r[:, None]
        if BACKWARD:
            g = tl.load(G + out_off, mask=out_mask, other=0.0).to(tl.float32)
            dn = r[:, None] * (g - o * (tl.sum(g * o, axis=1) / DV)[:, None])
            tl.store(DN + out_off, dn, mask=out_mask)
            tl.store(DD + bh * N + tok, tl.zeros_like(d), mask=tm)
        else:
            tl.store(OUT + out_off, o, mask=out_mask)
    else:
        guarded = tl.where(d >= 0, tl.maximum(d, eps), tl.minimum(d, -eps))
        if BACKWARD:
            g = tl.load(G + out_off, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(DN + out_off, g / guarded[:, None], mask=out_mask)
            passes = (d >= eps) | (d <= -eps)  # the guard's clamp passes the gradient
            dd = tl.where(passes, -tl.sum(g * n, axis=1) / (guarded * guarded), 0.0)
            tl.store(DD + bh * N + tok, dd, mask=tm)
        else:
            tl.store(OUT + out_off, n / guarded[:, None], mask=out_mask)


@triton.jit
def chunk_state_grads(
    Q, M, MB, DN, DD, DSF, DZF, DSTATES, DZS, DS0, DZ0,
    N, F, DV, NC,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0)
    pv = tl.program_id(1)
    f = tl.arange(0, BF)
    cols = pv * BV + tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    zm = fm & ((f * 0 + pv) == 0)
    t = tl.arange(0, CHUNK)
    state_off = f[:, None] * DV + cols[None, :]
    ds = tl.load(DSF + bh * F * DV + state_off, mask=fm[:, None] & vm[None, :], other=0.0).to(tl.float32)
    dz = tl.load(DZF + bh * F + f, mask=fm, other=0.0).to(tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        # gradient of the state after chunk c (= entering chunk c + 1)
        tl.store(DSTATES + (bh * NC + c) * F * DV + state_off, ds, mask=fm[:, None] & vm[None, :])
        tl.store(DZS + (bh * NC + c) * F + f, dz, mask=zm)
        m_prev = tl.load(MB + bh * (NC + 1) + c)
        m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
        tok = c * CHUNK + t
        tm = tok < N
        q = _tile(Q + bh * N * F, tok, tm, f, fm, F)
        m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
        dn = _tile(DN + bh * N * DV, tok, tm, cols, vm, DV)
        dd = tl.load(DD + bh * N + tok, mask=tm, other=0.0)
        qa = q * tl.where(tm, tl.exp(m_prev - m), 0.0)[:, None]
        decay = tl.exp(m_prev - m_cur)
        ds = ds * decay + tl.dot(tl.trans(qa), dn, input_precision=PREC)
        dz = dz * decay + tl.sum(qa * dd[:, None], axis=0)
    tl.store(DS0 + bh * F * DV + state_off, ds, mask=fm[:, None] & vm[None, :])
    tl.store(DZ0 + bh * F + f, dz, mask=zm)


@triton.jit
def chunk_grads(
    Q, K, V, LS, M, MB, STATES, ZS, DN, DD, DSTATES, DZS, DQ, DK, DV_OUT, DLS,
    N, F, DV, NC,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    f = tl.arange(0, BF)
    cols = tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    t = tl.arange(0, CHUNK)
    tok = c * CHUNK + t
    tm = tok < N
    q = _tile(Q + bh * N * F, tok, tm, f, fm, F)
    k = _tile(K + bh * N * F, tok, tm, f, fm, F)
    v = _tile(V + bh * N * DV, tok, tm, cols, vm, DV)
    dn = _tile(DN + bh * N * DV, tok, tm, cols, vm, DV)
    dd = tl.load(DD + bh * N + tok, mask=tm, other=0.0)
    s = _tile(STATES + (bh * NC + c) * F * DV, f, fm, cols, vm, DV)
    z = tl.load(ZS + (bh * NC + c) * F + f, mask=fm, other=0.0)
    ds = _tile(DSTATES + (bh * NC + c) * F * DV, f, fm, cols, vm, DV)
    dz = tl.load(DZS + (bh * NC + c) * F + f, mask=fm, other=0.0)
    ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
    m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
    m_prev = tl.load(MB + bh * (NC + 1) + c)
    m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
    causal = (t[None, :] <= t[:, None]) & tm[None, :] & tm[:, None]
    e = tl.exp(tl.where(causal, ls[None, :] - m[:, None], float("-inf")))  # [C(t), C(s)]
    w = tl.dot(q, tl.trans(k), input_precision=PREC) * e
    # dW'_ts = (dn_t . v_s + dd_t) exp(kls_s - m_t): the gradient of the q.k products
    dw = (tl.dot(dn, tl.trans(v), input_precision=PREC) + dd[:, None]) * e
    carry = tl.where(tm, tl.exp(m_prev - m), 0.0)
    dq = tl.dot(dw, k, input_precision=PREC) + carry[:, None] * (
        tl.dot(dn, tl.trans(s), input_precision=PREC) + dd[:, None] * z[None, :]
    )
    key_scale = tl.where(tm, tl.exp(ls - m_cur), 0.0)
    dk = tl.dot(tl.trans(dw), q, input_precision=PREC) + key_scale[:, None] * (
        tl.dot(v, tl.trans(ds), input_precision=PREC) + dz[None, :]
    )
    dv = tl.dot(tl.trans(w), dn, input_precision=PREC) + key_scale[:, None] * tl.dot(k, ds, input_precision=PREC)
    feat_off = bh * N * F + tok[:, None] * F + f[None, :]
    tl.store(DQ + feat_off, dq, mask=tm[:, None] & fm[None, :])
    tl.store(DK + feat_off, dk, mask=tm[:, None] & fm[None, :])
    tl.store(DV_OUT + bh * N * DV + tok[:, None] * DV + cols[None, :], dv, mask=tm[:, None] & vm[None, :])
    # every path of kls_s into the loss is exp(kls_s - .) kf_s, so dkls_s = kf_s . dkf_s
    tl.store(DLS + bh * N + tok, tl.sum(k * dk, axis=1), mask=tm)
