"""Triton kernels of the one-normaliser hybrid's chunked form (maths: ``window/`` and
``window/chunk.py``; glue: ``window.py``).

Layout: contiguous [BH, T, *], T = NC * CHUNK (the glue pads), keys aligned with the queries.
q, k [BH, T, D] (raw, for q.k / sqrt d), qf, kf [BH, T, F], qls, kls [BH, T] fp32, v_aug
[BH, T, DV + 1] (the last column: ones, the denominator's), states [BH, NC, F, DV + 1] fp32
(``chunk_states`` of ``linear_kernels.py`` run on v_aug: state c enters chunk c, relative to MB[c]).
Every row-major tile with DV + 1 columns is read as BV-wide blocks of the first DV columns plus
its last column as a vector: no power-of-two padding of DV + 1 to 2 DV.

Chunk c of queries attends to key chunks c - L .. c (L = ceil(W / C), at most NC - 1), one C x C
sub-block at a time, with the lag t - s = (c - j) C + i - i' deciding window (0 <= lag < W),
far-in-block (lag >= W) or nothing; no [C, (L + 1) C] or larger mask is ever built. The linear
state S_{max(c - L, 0)} carries every key before the block.

* ``window_outputs`` (grid (NC, BH)): the stabiliser m_t (online, like flash attention: the far
  bound qls_t + max(B_{c-L}, far-in-block kls) first, then each sub-block's window logits) and the
  numerator incl. the denominator column; stores m for the backward.
* ``window_grads_q`` (grid (NC, BH)): dq and dqf of one query chunk (sub-blocks + the carried read).
* ``window_grads_k`` (grid (NC, BH)): dk, dkf and dv_aug of one key chunk: the query chunks j .. j + L
  that see it, plus its share of the linear state (dU_j = dS_{j+1}, from ``chunk_state_grads``).

dq, dqf, dk, dkf, dv_aug are fp32 buffers the programs read, add to and write back per sub-block
(``_add_to``; each row belongs to one program: no atomics; the autotuner zeroes them before each
benchmark run), so no program keeps a [C, F] or [C, Dv] accumulator across its loops, and the
backward kernels loop over 32-wide blocks of D, F and Dv (C = 32: no spills at the 1.3B shape);
dqls = qf . dqf and dkls = kf . dkf (every path of a log-scale is exp(ls) times its features) are
summed by the glue. Dots: operands in the inputs' dtype, fp32 accumulation (``kernels.input_dot``);
carried states (fp32) via ``kernels.state_dot``; element-wise maths in fp32.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .linear_kernels import autotuned, input_dot, load_tile, state_dot


@triton.jit
def _aug(ptr, rows, cols, vm, DV):
    """[R, BV] tile of columns ``cols`` < DV (stored dtype) and the last column DV [R] (fp32) of a
    row-major [*, DV + 1] matrix."""
    rm = rows >= 0
    tile = load_tile(ptr, rows, rm, cols, vm, DV + 1)
    last = tl.load(ptr + rows * (DV + 1) + DV).to(tl.float32)
    return tile, last


@triton.jit
def _block_dot(A, B, bh, tq, tk, T, WIDTH, BW: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr):
    """[C, C] fp32 sum over WIDTH columns of A[tq] B[tk]^T (both [BH, T, WIDTH]), BW columns at a time."""
    acc = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    rm = tq >= 0
    for w0 in range(0, WIDTH, BW):
        w = w0 + tl.arange(0, BW)
        wm = w < WIDTH
        a = load_tile(A + bh * T * WIDTH, tq, rm, w, wm, WIDTH)
        b = load_tile(B + bh * T * WIDTH, tk, rm, w, wm, WIDTH)
        acc += input_dot(a, tl.trans(b), A.dtype.element_ty, PREC)
    return acc


@triton.jit
def _block_weights(
    Q, QF, K, KF, KLS, bh, c, j, tq, tk, qls, m, T, D, F, WINDOW, scale,
    CHUNK: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Query chunk c, key chunk j, stabiliser m [C]: (w_near, w, x_far) [C, C]: the window's
    weights exp(logit - m) (0 off the window), all weights w = w_near + x_far G, and
    x_far = exp(qls + kls - m) on far entries (0 elsewhere): no mask outlives this function."""
    i = tl.arange(0, CHUNK)
    lag = (c - j) * CHUNK + i[:, None] - i[None, :]
    logits = _block_dot(Q, K, bh, tq, tk, T, D, BD, CHUNK, PREC) * scale
    w_near = tl.exp(tl.where((lag >= 0) & (lag < WINDOW), logits, float("-inf")) - m[:, None])
    w = w_near
    x_far = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    if (c - j) * CHUNK + CHUNK - 1 >= WINDOW:  # the sub-block holds far keys
        kls = tl.load(KLS + bh * T + tk)
        x_far = tl.exp(tl.where(lag >= WINDOW, qls[:, None] + kls[None, :], float("-inf")) - m[:, None])
        w += x_far * _block_dot(QF, KF, bh, tq, tk, T, F, BF, CHUNK, PREC)
    return w_near, w, x_far


@triton.jit
def _dn_v(DNUM, V, bh, tq, tk, T, DV, BV: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr):
    """dw [C, C] = dn[tq] v_aug[tk]^T over the DV + 1 columns, BV at a time (dn fp32 [BH, T, DV + 1])."""
    acc = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    rm = tq >= 0
    for v0 in range(0, DV, BV):
        cols = v0 + tl.arange(0, BV)
        vm = cols < DV
        dn = load_tile(DNUM + bh * T * (DV + 1), tq, rm, cols, vm, DV + 1)
        v = load_tile(V + bh * T * (DV + 1), tk, rm, cols, vm, DV + 1)
        acc += input_dot(dn, tl.trans(v), V.dtype.element_ty, PREC)
    dn_last = tl.load(DNUM + bh * T * (DV + 1) + tq * (DV + 1) + DV)
    v_last = tl.load(V + bh * T * (DV + 1) + tk * (DV + 1) + DV).to(tl.float32)
    return acc + dn_last[:, None] * v_last[None, :]


@autotuned
@triton.jit
def window_outputs(
    Q, QF, QLS, K, KF, KLS, V, MB, STATES, NUMER, M_OUT,
    T, D, F, DV, NC, LOOKBACK, WINDOW, scale,
    CHUNK: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    elt = Q.dtype.element_ty
    i = tl.arange(0, CHUNK)
    tq = c * CHUNK + i
    cols = tl.arange(0, BV)
    vm = cols < DV
    qls = tl.load(QLS + bh * T + tq)
    first = tl.maximum(c - LOOKBACK, 0)
    b_read = tl.load(MB + bh * (NC + 1) + first)  # the read state's bound B_{max(c - L, 0)}
    # the far bound: qls_t + max(B, max kls over the block's far keys) (>= every far exponent)
    far_max = tl.zeros((CHUNK,), dtype=tl.float32) + b_read
    for j in range(first, c + 1):
        if (c - j) * CHUNK + CHUNK - 1 >= WINDOW:
            kls = tl.load(KLS + bh * T + j * CHUNK + i)
            lag = (c - j) * CHUNK + i[:, None] - i[None, :]
            far_max = tl.maximum(far_max, tl.max(tl.where(lag >= WINDOW, kls[None, :], float("-inf")), axis=1))
    m = qls + far_max  # -inf: no far field (yet)
    acc = tl.zeros((CHUNK, BV), dtype=tl.float32)
    den = tl.zeros((CHUNK,), dtype=tl.float32)
    for j in range(first, c + 1):
        tk = j * CHUNK + i
        lag = (c - j) * CHUNK + i[:, None] - i[None, :]
        near = (lag >= 0) & (lag < WINDOW)
        logits = tl.where(near, _block_dot(Q, K, bh, tq, tk, T, D, BD, CHUNK, PREC) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: weights 0
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha[:, None]
        den = den * alpha
        m = m_new
        w = tl.exp(logits - m_safe[:, None])
        if (c - j) * CHUNK + CHUNK - 1 >= WINDOW:
            kls = tl.load(KLS + bh * T + tk)
            x_far = tl.exp(tl.where(lag >= WINDOW, qls[:, None] + kls[None, :], float("-inf")) - m_safe[:, None])
            w += x_far * _block_dot(QF, KF, bh, tq, tk, T, F, BF, CHUNK, PREC)
        v, v_last = _aug(V + bh * T * (DV + 1), tk, cols, vm, DV)
        acc += input_dot(w, v, elt, PREC)
        den += tl.sum(w * v_last[None, :], axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    # the carried state: exp(qls_t + B - m_t) qf_t S (0 for an empty state, B = -inf)
    carry = tl.where(b_read == float("-inf"), 0.0, tl.exp(qls + b_read - m))
    state = STATES + (bh * NC + first) * F * (DV + 1)
    qs = tl.zeros((CHUNK, BV), dtype=tl.float32)
    qz = tl.zeros((CHUNK,), dtype=tl.float32)
    for f0 in range(0, F, BF):
        f = f0 + tl.arange(0, BF)
        fm = f < F
        qf = load_tile(QF + bh * T * F, tq, tq >= 0, f, fm, F)
        s = load_tile(state, f, fm, cols, vm, DV + 1)
        z = tl.load(state + f * (DV + 1) + DV, mask=fm, other=0.0)
        qs += state_dot(qf, s, elt)
        qz += tl.sum(qf.to(tl.float32) * z[None, :], axis=1)
    acc += carry[:, None] * qs
    den += carry * qz
    out = NUMER + bh * T * (DV + 1)
    tl.store(out + tq[:, None] * (DV + 1) + cols[None, :], acc, mask=(tq >= 0)[:, None] & vm[None, :])
    tl.store(out + tq * (DV + 1) + DV, den)
    tl.store(M_OUT + bh * T + tq, m)


@triton.jit
def _add_to(OUT, rows, rm, cols, cm, stride, value):
    """OUT[rows, cols] += value (an fp32 buffer whose rows only this program writes)."""
    off = OUT + rows[:, None] * stride + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    tl.store(off, tl.load(off, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _add_dot(OUT, bh, rows, T, WIDTH, STRIDE, a, B, b_rows, b_stride, scale, ELT: tl.constexpr, BW: tl.constexpr,
             PREC: tl.constexpr):  # fmt: skip
    """OUT[rows, :WIDTH] += scale * a @ B[b_rows, :WIDTH] (a [C, C] fp32; B [BH, T, b_stride];
    OUT fp32 [BH, T, STRIDE]), BW columns at a time."""
    rm = rows >= 0
    for w0 in range(0, WIDTH, BW):
        w = w0 + tl.arange(0, BW)
        wm = w < WIDTH
        b = load_tile(B + bh * T * b_stride, b_rows, rm, w, wm, b_stride)
        _add_to(OUT + bh * T * STRIDE, rows, rm, w, wm, STRIDE, scale * input_dot(a, b, ELT, PREC))


@functools.partial(autotuned, reset_to_zero=["DQ", "DQF"])
@triton.jit
def window_grads_q(
    Q, QF, QLS, K, KF, KLS, V, M, MB, STATES, DNUM, DQ, DQF,
    T, D, F, DV, NC, LOOKBACK, WINDOW, scale,
    CHUNK: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dq, dqf of query chunk c, added into the zeroed fp32 DQ [BH, T, D], DQF [BH, T, F]."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    elt = Q.dtype.element_ty
    i = tl.arange(0, CHUNK)
    tq = c * CHUNK + i
    qls = tl.load(QLS + bh * T + tq)
    m = tl.load(M + bh * T + tq)
    first = tl.maximum(c - LOOKBACK, 0)
    for j in range(first, c + 1):
        tk = j * CHUNK + i
        w_near, w, x_far = _block_weights(Q, QF, K, KF, KLS, bh, c, j, tq, tk, qls, m, T, D, F, WINDOW, scale,
                                          CHUNK, BD, BF, PREC)  # fmt: skip
        dw = _dn_v(DNUM, V, bh, tq, tk, T, DV, BV, CHUNK, PREC)
        _add_dot(DQ, bh, tq, T, D, D, dw * w_near, K, tk, D, scale, elt, BD, PREC)  # dL/dlogits
        if (c - j) * CHUNK + CHUNK - 1 >= WINDOW:
            _add_dot(DQF, bh, tq, T, F, F, dw * x_far, KF, tk, F, 1.0, elt, BF, PREC)  # dL/dG
    # the carried read: dqf_t += exp(qls_t + B - m_t) dn_t S^T, S = STATES[max(c - L, 0)]
    b_read = tl.load(MB + bh * (NC + 1) + first)
    carry = tl.where(b_read == float("-inf"), 0.0, tl.exp(qls + b_read - m))
    state = STATES + (bh * NC + first) * F * (DV + 1)
    dn_last = tl.load(DNUM + bh * T * (DV + 1) + tq * (DV + 1) + DV) * carry
    for f0 in range(0, F, BF):
        f = f0 + tl.arange(0, BF)
        fm = f < F
        z = tl.load(state + f * (DV + 1) + DV, mask=fm, other=0.0)
        part = dn_last[:, None] * z[None, :]
        for v0 in range(0, DV, BV):
            cols = v0 + tl.arange(0, BV)
            vm = cols < DV
            dn = load_tile(DNUM + bh * T * (DV + 1), tq, tq >= 0, cols, vm, DV + 1) * carry[:, None]
            part += state_dot(dn, tl.trans(load_tile(state, f, fm, cols, vm, DV + 1)), elt)
        _add_to(DQF + bh * T * F, tq, tq >= 0, f, fm, F, part)


@functools.partial(autotuned, reset_to_zero=["DK", "DKF", "DV_OUT"])
@triton.jit
def window_grads_k(
    Q, QF, QLS, K, KF, KLS, V, M, MB, DSTATES, DNUM, DK, DKF, DV_OUT,
    T, D, F, DV, NC, LOOKBACK, WINDOW, scale,
    CHUNK: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dk, dkf, dv_aug of key chunk j, added into the zeroed fp32 DK, DKF, DV_OUT [BH, T, DV + 1]."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    elt = Q.dtype.element_ty
    i = tl.arange(0, CHUNK)
    tk = j * CHUNK + i
    dv_last = tl.zeros((CHUNK,), dtype=tl.float32)
    last = tl.minimum(j + LOOKBACK, NC - 1)
    for c in range(j, last + 1):
        tq = c * CHUNK + i
        qls = tl.load(QLS + bh * T + tq)
        m = tl.load(M + bh * T + tq)
        w_near, w, x_far = _block_weights(Q, QF, K, KF, KLS, bh, c, j, tq, tk, qls, m, T, D, F, WINDOW, scale,
                                          CHUNK, BD, BF, PREC)  # fmt: skip
        dw = _dn_v(DNUM, V, bh, tq, tk, T, DV, BV, CHUNK, PREC)
        wt = tl.trans(w)
        _add_dot(DV_OUT, bh, tk, T, DV, DV + 1, wt, DNUM, tq, DV + 1, 1.0, elt, BV, PREC)
        dv_last += tl.sum(wt * tl.load(DNUM + bh * T * (DV + 1) + tq * (DV + 1) + DV)[None, :], axis=1)
        _add_dot(DK, bh, tk, T, D, D, tl.trans(dw * w_near), Q, tq, D, scale, elt, BD, PREC)
        if (c - j) * CHUNK + CHUNK - 1 >= WINDOW:
            _add_dot(DKF, bh, tk, T, F, F, tl.trans(dw * x_far), QF, tq, F, 1.0, elt, BF, PREC)
    # the linear state: U_j = sum_s exp(kls_s - B_{j+1}) kf_s v_s^T enters S_{j+1}, dU_j = dS_{j+1}
    kls = tl.load(KLS + bh * T + tk)
    b_next = tl.load(MB + bh * (NC + 1) + j + 1)
    # 0 for keys with log-scale -inf (padding; every key of a softmax core, whose bound is -inf too)
    key_scale = tl.where(kls == float("-inf"), 0.0, tl.exp(kls - tl.where(b_next == float("-inf"), 0.0, b_next)))
    dstate = DSTATES + (bh * NC + j) * F * (DV + 1)
    v_last = tl.load(V + bh * T * (DV + 1) + tk * (DV + 1) + DV).to(tl.float32) * key_scale
    for f0 in range(0, F, BF):  # dkf_s += key_scale_s v_aug_s dU^T
        f = f0 + tl.arange(0, BF)
        fm = f < F
        du_last = tl.load(dstate + f * (DV + 1) + DV, mask=fm, other=0.0)
        part = v_last[:, None] * du_last[None, :]
        kf = load_tile(KF + bh * T * F, tk, tk >= 0, f, fm, F)
        dv_last += key_scale * tl.sum(kf.to(tl.float32) * du_last[None, :], axis=1)
        for v0 in range(0, DV, BV):
            cols = v0 + tl.arange(0, BV)
            vm = cols < DV
            v = load_tile(V + bh * T * (DV + 1), tk, tk >= 0, cols, vm, DV + 1).to(tl.float32) * key_scale[:, None]
            part += state_dot(v, tl.trans(load_tile(dstate, f, fm, cols, vm, DV + 1)), elt)
        _add_to(DKF + bh * T * F, tk, tk >= 0, f, fm, F, part)
    out = DV_OUT + bh * T * (DV + 1)
    for v0 in range(0, DV, BV):  # dv_s += key_scale_s kf_s dU
        cols = v0 + tl.arange(0, BV)
        vm = cols < DV
        part = tl.zeros((CHUNK, BV), dtype=tl.float32)
        for f0 in range(0, F, BF):
            f = f0 + tl.arange(0, BF)
            fm = f < F
            kf = load_tile(KF + bh * T * F, tk, tk >= 0, f, fm, F)
            part += state_dot(kf, load_tile(dstate, f, fm, cols, vm, DV + 1), elt)
        _add_to(out, tk, tk >= 0, cols, vm, DV + 1, key_scale[:, None] * part)
    tl.store(out + tk * (DV + 1) + DV, tl.load(out + tk * (DV + 1) + DV) + dv_last)
