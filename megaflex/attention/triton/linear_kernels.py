"""Triton kernels of chunked causal linear attention (the maths of ``core.py``; glue: ``linear.py``).

Layout: every tensor is contiguous [BH, N, *] (batch x heads flattened). ``MB`` [BH, NC + 1]
holds the chunk stabilisers: MB[:, 0] = the carried state's log_max, MB[:, c + 1] = m at the
last token of chunk c. ``M`` [BH, N] is the per-token running max m_t. Every exponent is <= 0.
States: ``S`` [F, Dv] (kv) and ``Z`` [F] (k_sum), fp32, relative to their chunk's stabiliser.

Precision: ``tl.dot`` operands are in the inputs' dtype (``input_dot`` casts fp32 intermediates such
as the C x C weights to it) and accumulate in fp32, as in flash attention: bf16 / fp16 operands
take half the shared memory and registers of fp32 ones and run at the full tensor-core rate.
fp32 inputs keep fp32 operands with ``PREC`` ("tf32" on CUDA). Products with a carried state
(``state_dot``) split the state into two half-precision parts (3xTF32 for fp32 inputs):
the state is where rounding hurts. Element-wise maths (exp, sums, normalisation) is fp32. The interpreter
computes every dot in fp32 from the (rounded) operands.

Tiling: the feature dimension F and the value width Dv are cut into BF x BV blocks. The scans
run one program per (BH, F block, Dv block); the chunk kernels loop over the blocks of the
dimension they contract (``chunk_outputs`` over F, since its rms norm needs whole rows of Dv),
so no program holds an F x Dv state or a C x F tile of full width at the 1.3B shape.

Offsets: program ids are widened to int64 before they multiply a stride (``bh * N * F`` passes
2^31 at long context), vector offsets inside one head stay int32.

Kernels (five launches forward + backward; none loops in Python over heads, batch or chunks):

* ``chunk_states``: sequential over chunks, parallel over (BH, F blocks, Dv blocks): the state
  entering every chunk, and the final state. (Backward recomputes them.)
* ``chunk_outputs``: parallel over (chunks, BH): intra-chunk C x C block + carried state, then
  the normalisation (``RMS``; else the denominator, capped at ``CAP`` > 0). With ``BACKWARD`` it
  turns the output gradient into dn, dd (gradients of the numerator and denominator), recomputing
  n and d.
* ``chunk_state_grads``: reverse scan, like ``chunk_states``: dL/dS after every chunk and of the
  initial state.
* ``chunk_grads_qk``: parallel over (chunks, BH, F blocks): dq, dk and a partial dkls.
* ``chunk_grads_v``:  parallel over (chunks, BH, Dv blocks): dv.

Features: given ([BH, N, F] inputs), or with the constexpr ``TRIG`` computed in registers from
the raw q, k [BH, N, d] and the trig map's frequencies (``_features``; ``trig_linear_attention``'s
default, what the dispatcher runs): projections accumulated over 32-wide head-dim blocks (BD),
cos/sin by Cody-Waite reduction and polynomials (``_cos_shifted``, ``_sin_cos``); then
``trig_grads`` (parallel over (BH, frequency blocks), sequential over chunks) turns the feature
gradients into dq, dk and per-(batch, head) domega. Every kernel is autotuned over
``tuning.launch_configs`` (one config under the interpreter), TRIG launches over 8-warp
configs only. Compiled for sm_80 / sm_90 (triton 3.9.0, bf16, docs/results/triton_aot.json):
no spills at 247M/41M/tiny, at most 16 B (sm_90; 8 B on sm_80) at 1.3B. libdevice's cosf,
whose Payne-Hanek path keeps a local array, and whole [C, d] x tiles had made chunk_outputs
spill 3.9-4.4 KB on sm_80 at 1.3B.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tuning import TUNING_KEY, interpreter_enabled, launch_configs, prune_launch_configs


def autotuned(fn, reset_to_zero: list[str] | None = None):
    """``fn`` autotuned over ``launch_configs`` (one fixed config under the interpreter), pruned
    per launch by ``prune_launch_configs`` (TRIG launches take fewer). These kernels only store
    (no accumulation into their outputs), so benchmark reruns are harmless; kernels that add into
    zeroed outputs (``window_kernels.py``) name them in ``reset_to_zero`` (zeroed before each
    benchmark run and before the real one)."""
    name = fn.__name__
    configs = launch_configs(name, interpreted=interpreter_enabled())
    key = [arg for arg in TUNING_KEY if arg in fn.arg_names]
    prune = {"early_config_prune": lambda configs, _named, **constexprs: prune_launch_configs(name, configs, constexprs)}
    return triton.autotune(
        [triton.Config({}, num_warps=w, num_stages=s) for w, s in configs], key=key, prune_configs_by=prune,
        reset_to_zero=reset_to_zero,
    )(fn)


@triton.jit
def load_tile(ptr, rows, row_mask, cols, col_mask, stride):
    """[len(rows), len(cols)] tile of a row-major matrix in its stored dtype (zeros outside the masks)."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def input_dot(a, b, ELT: tl.constexpr, PREC: tl.constexpr):
    """a @ b with both operands in ELT (the inputs' dtype) and fp32 accumulation."""
    return tl.dot(a.to(ELT), b.to(ELT), input_precision=PREC, out_dtype=tl.float32)


@triton.jit
def state_dot(a, s, ELT: tl.constexpr):
    """a @ s where s is a carried state (or state gradient), fp32 in memory. Rounding s to 10 or
    8 mantissa bits gave 2% output and 45% dq errors on ill-conditioned rms rows (fp16, key
    scales x100; tests/attention/test_attention_triton.py), so s is split into two half-precision parts
    s_hi + s_lo (~21 / 16 bits) and multiplied twice; fp32 inputs use 3xTF32 instead."""
    if ELT == tl.float32:
        return tl.dot(a, s, input_precision="tf32x3", out_dtype=tl.float32)
    s_hi = s.to(ELT)
    s_lo = (s - s_hi.to(tl.float32)).to(ELT)
    a_half = a.to(ELT)
    return tl.dot(a_half, s_hi, out_dtype=tl.float32) + tl.dot(a_half, s_lo, out_dtype=tl.float32)


@triton.jit
def _trig_proj(x, w_rows, freq, fm, d, dm, DIN):
    """x [C, BD] (the inputs' dtype) times the fp32 frequencies ``w_rows[freq]`` [BF, BD]^T: [C, BF]
    fp32 projections. A cos/sin argument needs about fp32 accuracy (one rounding of the
    frequencies to bf16 would err by |proj| 2^-9), so they are multiplied as a state is
    (``state_dot``: two half-precision parts, 3xTF32 for fp32 inputs); x is exact in its dtype."""
    w = load_tile(w_rows, freq, fm, d, dm, DIN).to(tl.float32)
    return state_dot(x, tl.trans(w), x.dtype)


@triton.jit
def _quadrant(p):
    """p = r + j pi/2 with |r| <= pi/4: (r, j mod 4). Cody-Waite reduction (pi/2 in three parts,
    the first two exact in fp32 times any |j| < 2^15), so r keeps fp32 accuracy for |p| < ~5e4."""
    j = tl.floor(p * 0.6366197723675814 + 0.5)
    r = ((p - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.54978995489188216e-8
    return r, j.to(tl.int32) & 3


@triton.jit
def _sin_cos_reduced(r):
    """(sin r, cos r) for |r| <= pi/4: Cephes' single-precision polynomials (errors ~1 ulp)."""
    z = r * r
    sin_r = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    cos_r = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    return sin_r, cos_r


@triton.jit
def _cos_shifted(p, shift):
    """cos(p - shift pi/2) (shift: 0 for cos p, 1 for sin p), by ``_quadrant`` and polynomials. Not
    tl.cos: libdevice's cosf carries a Payne-Hanek path for huge arguments whose local array and
    registers made the trig kernels spill (2.3 KB stack frame, 3.9 KB spills at the 1.3B shape)."""
    r, j = _quadrant(p)
    n = (j - shift) & 3
    sin_r, cos_r = _sin_cos_reduced(r)
    # cos(r + n pi/2) = cos r, -sin r, -cos r, sin r for n = 0..3
    value = tl.where((n & 1) == 0, cos_r, sin_r)
    return tl.where((n == 1) | (n == 2), -value, value)


@triton.jit
def _sin_cos(p):
    """(sin p, cos p) sharing one ``_quadrant`` reduction."""
    r, n = _quadrant(p)
    sin_r, cos_r = _sin_cos_reduced(r)
    # sin(r + n pi/2) = sin r, cos r, -sin r, -cos r; cos(r + n pi/2) = cos r, -sin r, -cos r, sin r
    odd = (n & 1) == 1
    sin_p = tl.where(odd, cos_r, sin_r)
    cos_p = tl.where(odd, sin_r, cos_r)
    return tl.where(n >= 2, -sin_p, sin_p), tl.where((n == 1) | (n == 2), -cos_p, cos_p)


@triton.jit
def _trig_projs(
    x_rows, w_head, tok, tm, freq, fm, DIN, half,
    PAIRED: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """[C, BF] fp32 projections of tokens ``tok`` on frequencies ``freq`` (and on ``half + freq``
    when PAIRED), accumulated over BD-wide blocks of the head dim: one [C, BD] block of x is live
    at a time (a whole [C, 128] x tile per operand made chunk_outputs spill at the 1.3B shape)."""
    p1 = tl.zeros((CHUNK, BF), dtype=tl.float32)
    p2 = tl.zeros((CHUNK, BF), dtype=tl.float32)
    for d0 in range(0, DIN, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < DIN
        x = load_tile(x_rows, tok, tm, d, dm, DIN)
        p1 += _trig_proj(x, w_head, freq, fm, d, dm, DIN)
        if PAIRED:
            p2 += _trig_proj(x, w_head + half * DIN, freq, fm, d, dm, DIN)
    return p1, p2


@triton.jit
def _features(
    X, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale,
    TRIG: tl.constexpr, PAIRED: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """The [C, BF] feature tile of tokens ``tok``, columns ``f`` (zero outside the masks): loaded
    from X [BH, N, F], or with ``TRIG`` computed in registers from x = X [BH, N, DIN] and the
    head's frequencies W [HEADS, P, DIN]: the map of ``feature_maps/trig.py`` (column f < F/2 is
    the cosine of frequency f, the rest the sines; paired maps add those of W[h, F/2 + f]), times
    ``trig_scale``, in fp32."""
    if TRIG:
        half = F // 2
        sin_cols = f >= half
        freq = tl.where(sin_cols, f - half, f)
        w_head = W + (bh % HEADS) * (2 * half if PAIRED else half) * DIN
        p1, p2 = _trig_projs(X + bh * N * DIN, w_head, tok, tm, freq, fm, DIN, half, PAIRED, BD, CHUNK, BF)
        shift = tl.where(sin_cols, 1, 0)[None, :]  # sin p = cos(p - pi/2): one cosine per column
        feat = _cos_shifted(p1, shift)
        if PAIRED:
            feat += _cos_shifted(p2, shift)
        return tl.where(tm[:, None] & fm[None, :], feat * trig_scale, 0.0)
    else:
        return load_tile(X + bh * N * F, tok, tm, f, fm, F)


@autotuned
@triton.jit
def chunk_states(
    K, V, LS, MB, S0, Z0, STATES, ZS, SF, ZF,
    N, F, DV, NC, W, HEADS, DIN, trig_scale,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    TRIG: tl.constexpr, PAIRED: tl.constexpr, BD: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(2)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    cols = pv * BV + tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    zm = fm & ((f * 0 + pv) == 0)  # k_sum is written by the first Dv block only
    t = tl.arange(0, CHUNK)
    state_off = f[:, None] * DV + cols[None, :]
    state_mask = fm[:, None] & vm[None, :]
    s = tl.load(S0 + bh * F * DV + state_off, mask=state_mask, other=0.0).to(tl.float32)
    z = tl.load(Z0 + bh * F + f, mask=fm, other=0.0).to(tl.float32)
    for c in range(NC):
        tl.store(STATES + (bh * NC + c) * F * DV + state_off, s, mask=state_mask)
        tl.store(ZS + (bh * NC + c) * F + f, z, mask=zm)
        m_prev = tl.load(MB + bh * (NC + 1) + c)
        m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
        tok = c * CHUNK + t
        tm = tok < N
        k = _features(K, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        v = load_tile(V + bh * N * DV, tok, tm, cols, vm, DV)
        ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
        kw = k.to(tl.float32) * tl.where(tm, tl.exp(ls - m_cur), 0.0)[:, None]
        decay = tl.exp(m_prev - m_cur)
        s = s * decay + input_dot(tl.trans(kw), v, K.dtype.element_ty, PREC)
        z = z * decay + tl.sum(kw, axis=0)
    tl.store(SF + bh * F * DV + state_off, s, mask=state_mask)
    tl.store(ZF + bh * F + f, z, mask=zm)


@autotuned
@triton.jit
def chunk_outputs(
    Q, K, V, LS, M, MB, STATES, ZS, OUT, G, DN, DD,
    N, F, DV, NC, eps, W, HEADS, DIN, trig_scale,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    RMS: tl.constexpr, CAP: tl.constexpr, BACKWARD: tl.constexpr, TRIG: tl.constexpr, PAIRED: tl.constexpr,
    BD: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    elt = Q.dtype.element_ty
    cols = tl.arange(0, BV)
    vm = cols < DV
    t = tl.arange(0, CHUNK)
    tok = c * CHUNK + t
    tm = tok < N
    state = (bh * NC + c) * F
    qk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    qs = tl.zeros((CHUNK, BV), dtype=tl.float32)
    qz = tl.zeros((CHUNK,), dtype=tl.float32)
    for f0 in range(0, F, BF):
        f = f0 + tl.arange(0, BF)
        fm = f < F
        q = _features(Q, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        k = _features(K, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        s = load_tile(STATES + state * DV, f, fm, cols, vm, DV)
        z = tl.load(ZS + state + f, mask=fm, other=0.0)
        qk += input_dot(q, tl.trans(k), elt, PREC)
        qs += state_dot(q, s, elt)
        qz += tl.sum(q.to(tl.float32) * z[None, :], axis=1)
    v = load_tile(V + bh * N * DV, tok, tm, cols, vm, DV)
    ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
    m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
    m_prev = tl.load(MB + bh * (NC + 1) + c)
    causal = (t[None, :] <= t[:, None]) & tm[None, :]
    # exponent masked to -inf before exp: a later key may have a larger log-scale than m_t
    w = qk * tl.exp(tl.where(causal, ls[None, :] - m[:, None], float("-inf")))
    carry = tl.exp(m_prev - m)
    n = input_dot(w, v, elt, PREC) + carry[:, None] * qs
    d = tl.sum(w, axis=1) + carry * qz
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
    elif CAP > 0:  # "capped_denominator": G = max(d, r / CAP), r = (mean n^2 + eps^2)^1/2 (base.py)
        r = tl.sqrt(tl.sum(n * n, axis=1) / DV + eps * eps)
        guarded = tl.maximum(d, r / CAP)
        if BACKWARD:  # where d wins: dn = g / G, dd = -(g . n) / G^2; where the floor wins (the RMS norm
            # scaled to CAP): dn = g / G - CAP mean(n g) / r^3 n, dd = 0 (chunked._normalize_backward)
            g = tl.load(G + out_off, mask=out_mask, other=0.0).to(tl.float32)
            ng = tl.sum(g * n, axis=1)
            ratio = d >= guarded
            coef = tl.where(ratio, 0.0, ng / DV * CAP / (r * r * r))
            tl.store(DN + out_off, g / guarded[:, None] - coef[:, None] * n, mask=out_mask)
            tl.store(DD + bh * N + tok, tl.where(ratio, -ng / (guarded * guarded), 0.0), mask=tm)
        else:
            tl.store(OUT + out_off, n / guarded[:, None], mask=out_mask)
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


@autotuned
@triton.jit
def chunk_state_grads(
    Q, M, MB, DN, DD, DSF, DZF, DSTATES, DZS, DS0, DZ0,
    N, F, DV, NC, W, HEADS, DIN, trig_scale,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    TRIG: tl.constexpr, PAIRED: tl.constexpr, BD: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(2)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    cols = pv * BV + tl.arange(0, BV)
    fm = f < F
    vm = cols < DV
    zm = fm & ((f * 0 + pv) == 0)
    t = tl.arange(0, CHUNK)
    state_off = f[:, None] * DV + cols[None, :]
    state_mask = fm[:, None] & vm[None, :]
    ds = tl.load(DSF + bh * F * DV + state_off, mask=state_mask, other=0.0).to(tl.float32)
    dz = tl.load(DZF + bh * F + f, mask=fm, other=0.0).to(tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        # gradient of the state after chunk c (= entering chunk c + 1)
        tl.store(DSTATES + (bh * NC + c) * F * DV + state_off, ds, mask=state_mask)
        tl.store(DZS + (bh * NC + c) * F + f, dz, mask=zm)
        m_prev = tl.load(MB + bh * (NC + 1) + c)
        m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
        tok = c * CHUNK + t
        tm = tok < N
        q = _features(Q, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
        dn = load_tile(DN + bh * N * DV, tok, tm, cols, vm, DV)
        dd = tl.load(DD + bh * N + tok, mask=tm, other=0.0)
        qa = q.to(tl.float32) * tl.where(tm, tl.exp(m_prev - m), 0.0)[:, None]
        decay = tl.exp(m_prev - m_cur)
        ds = ds * decay + input_dot(tl.trans(qa), dn, Q.dtype.element_ty, PREC)
        dz = dz * decay + tl.sum(qa * dd[:, None], axis=0)
    tl.store(DS0 + bh * F * DV + state_off, ds, mask=state_mask)
    tl.store(DZ0 + bh * F + f, dz, mask=zm)


@triton.jit
def _chunk_scales(LS, M, MB, bh, c, tok, tm, N, NC, CHUNK: tl.constexpr):
    """Of chunk c (tokens ``tok``, valid where ``tm``): e [C(t), C(s)] = causal exp(kls_s - m_t),
    the carry exp(m_prev - m_t) and the key scales exp(kls_s - m_end) (both zero on padding)."""
    t = tl.arange(0, CHUNK)
    ls = tl.load(LS + bh * N + tok, mask=tm, other=0.0)
    m = tl.load(M + bh * N + tok, mask=tm, other=0.0)
    m_prev = tl.load(MB + bh * (NC + 1) + c)
    m_cur = tl.load(MB + bh * (NC + 1) + c + 1)
    causal = (t[None, :] <= t[:, None]) & tm[None, :] & tm[:, None]
    e = tl.exp(tl.where(causal, ls[None, :] - m[:, None], float("-inf")))
    carry = tl.where(tm, tl.exp(m_prev - m), 0.0)
    key_scale = tl.where(tm, tl.exp(ls - m_cur), 0.0)
    return e, carry, key_scale


@autotuned
@triton.jit
def chunk_grads_qk(
    Q, K, V, LS, M, MB, STATES, ZS, DN, DD, DSTATES, DZS, DQ, DK, DLS,
    N, F, DV, NC, W, HEADS, DIN, trig_scale,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    TRIG: tl.constexpr, PAIRED: tl.constexpr, BD: tl.constexpr,
):
    """dq, dk of one (chunk, F block) and sum_f kf dkf over the block (DLS [F blocks, BH, N])."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pf = tl.program_id(2)
    elt = Q.dtype.element_ty
    f = pf * BF + tl.arange(0, BF)
    fm = f < F
    tok = c * CHUNK + tl.arange(0, CHUNK)
    tm = tok < N
    state = (bh * NC + c) * F
    dnv = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)  # dn_t . v_s
    dns = tl.zeros((CHUNK, BF), dtype=tl.float32)  # dn S^T
    vds = tl.zeros((CHUNK, BF), dtype=tl.float32)  # v dS^T
    for v0 in range(0, DV, BV):
        cols = v0 + tl.arange(0, BV)
        vm = cols < DV
        v = load_tile(V + bh * N * DV, tok, tm, cols, vm, DV)
        dn = load_tile(DN + bh * N * DV, tok, tm, cols, vm, DV)
        s = load_tile(STATES + state * DV, f, fm, cols, vm, DV)
        ds = load_tile(DSTATES + state * DV, f, fm, cols, vm, DV)
        dnv += input_dot(dn, tl.trans(v), elt, PREC)
        dns += state_dot(dn, tl.trans(s), elt)
        vds += state_dot(v, tl.trans(ds), elt)
    q = _features(Q, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
    k = _features(K, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
    dd = tl.load(DD + bh * N + tok, mask=tm, other=0.0)
    z = tl.load(ZS + state + f, mask=fm, other=0.0)
    dz = tl.load(DZS + state + f, mask=fm, other=0.0)
    # the C x C scales only now, after the loop: fewer registers live across it
    e, carry, key_scale = _chunk_scales(LS, M, MB, bh, c, tok, tm, N, NC, CHUNK)
    # dW'_ts = (dn_t . v_s + dd_t) exp(kls_s - m_t): the gradient of the q.k products
    dw = (dnv + dd[:, None]) * e
    dq = input_dot(dw, k, elt, PREC) + carry[:, None] * (dns + dd[:, None] * z[None, :])
    dk = input_dot(tl.trans(dw), q, elt, PREC) + key_scale[:, None] * (vds + dz[None, :])
    feat_off = bh * N * F + tok[:, None] * F + f[None, :]
    tl.store(DQ + feat_off, dq, mask=tm[:, None] & fm[None, :])
    tl.store(DK + feat_off, dk, mask=tm[:, None] & fm[None, :])
    # every path of kls_s into the loss is exp(kls_s - .) kf_s, so dkls_s = kf_s . dkf_s
    bhs = tl.num_programs(1)
    tl.store(DLS + (pf * bhs + bh) * N + tok, tl.sum(k.to(tl.float32) * dk, axis=1), mask=tm)


@autotuned
@triton.jit
def chunk_grads_v(
    Q, K, LS, M, MB, DN, DSTATES, DV_OUT,
    N, F, DV, NC, W, HEADS, DIN, trig_scale,
    CHUNK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    TRIG: tl.constexpr, PAIRED: tl.constexpr, BD: tl.constexpr,
):
    """dv of one (chunk, Dv block): W^T dn + key scales x (k dS)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    elt = Q.dtype.element_ty
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = cols < DV
    tok = c * CHUNK + tl.arange(0, CHUNK)
    tm = tok < N
    state = (bh * NC + c) * F
    qk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    kds = tl.zeros((CHUNK, BV), dtype=tl.float32)
    for f0 in range(0, F, BF):
        f = f0 + tl.arange(0, BF)
        fm = f < F
        q = _features(Q, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        k = _features(K, W, bh, tok, tm, f, fm, N, F, DIN, HEADS, trig_scale, TRIG, PAIRED, BD, CHUNK, BF)
        ds = load_tile(DSTATES + state * DV, f, fm, cols, vm, DV)
        qk += input_dot(q, tl.trans(k), elt, PREC)
        kds += state_dot(k, ds, elt)
    e, _, key_scale = _chunk_scales(LS, M, MB, bh, c, tok, tm, N, NC, CHUNK)
    dn = load_tile(DN + bh * N * DV, tok, tm, cols, vm, DV)
    dv = input_dot(tl.trans(qk * e), dn, elt, PREC) + key_scale[:, None] * kds
    tl.store(DV_OUT + bh * N * DV + tok[:, None] * DV + cols[None, :], dv, mask=tm[:, None] & vm[None, :])


@triton.jit
def _trig_d_proj(proj, g_cos, g_sin, trig_scale):
    """dL/dproj [C, BJ] of one frequency set: s (cos p g_sin - sin p g_cos)."""
    sin_p, cos_p = _sin_cos(proj)
    return trig_scale * (cos_p * g_sin - sin_p * g_cos)


@autotuned
@triton.jit
def trig_grads(
    X, W, G, DX_PARTS, DW,
    N, F, DIN, HEADS, NC, trig_scale,
    CHUNK: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The trig map's backward for one (BH, block of BJ frequencies), sequential over chunks: from
    the feature gradient G [BH, N, F] (cosine columns, then sine columns) and x = X [BH, N, DIN],
    this block's share of dL/dx (DX_PARTS [frequency blocks, BH, N, DIN], summed in torch) and
    dL/dW of its frequency rows for this bh (DW [BH, P, DIN], summed over the batch in torch).
    Projections (over BK-wide head-dim blocks, ``_trig_projs``) and their cos/sin are recomputed
    in registers, never stored. dx takes one dot per frequency set with W rounded to the inputs'
    dtype: its error is that of dL/dproj, itself rounded to that dtype as a dot operand."""
    bh = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    bhs = tl.num_programs(0)
    elt = X.dtype.element_ty
    half = F // 2
    rows = 2 * half if PAIRED else half
    freq = jb * BJ + tl.arange(0, BJ)
    jm = freq < half
    d = tl.arange(0, BD)
    dm = d < DIN
    w_head = W + (bh % HEADS) * rows * DIN
    dw1 = tl.zeros((BJ, BD), dtype=tl.float32)
    dw2 = tl.zeros((BJ, BD), dtype=tl.float32)
    for c in range(NC):
        tok = c * CHUNK + tl.arange(0, CHUNK)
        tm = tok < N
        g_cos = load_tile(G + bh * N * F, tok, tm, freq, jm, F)
        g_sin = load_tile(G + bh * N * F + half, tok, tm, freq, jm, F)
        p1, p2 = _trig_projs(X + bh * N * DIN, w_head, tok, tm, freq, jm, DIN, half, PAIRED, BK, CHUNK, BJ)
        x = load_tile(X + bh * N * DIN, tok, tm, d, dm, DIN)
        dp = _trig_d_proj(p1, g_cos, g_sin, trig_scale)
        dx = input_dot(dp, load_tile(w_head, freq, jm, d, dm, DIN), elt, PREC)
        dw1 += input_dot(tl.trans(dp), x, elt, PREC)
        if PAIRED:
            dp = _trig_d_proj(p2, g_cos, g_sin, trig_scale)
            dx += input_dot(dp, load_tile(w_head + half * DIN, freq, jm, d, dm, DIN), elt, PREC)
            dw2 += input_dot(tl.trans(dp), x, elt, PREC)
        dx_off = (jb * bhs + bh) * N * DIN + tok[:, None] * DIN + d[None, :]
        tl.store(DX_PARTS + dx_off, dx, mask=tm[:, None] & dm[None, :])
    w_mask = jm[:, None] & dm[None, :]
    dw_off = bh * rows * DIN + freq[:, None] * DIN + d[None, :]
    tl.store(DW + dw_off, dw1, mask=w_mask)
    if PAIRED:
        tl.store(DW + dw_off + half * DIN, dw2, mask=w_mask)
