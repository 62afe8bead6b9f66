"""The one-normaliser hybrid's chunked form as one autograd Function (the training path).

Same maths as the package doc (``window/__init__.py``; ``chunk_blocks.py`` is the torch-ops
reference this agrees with to rounding). Chunks of C queries; with L = ceil(W / C), chunk c attends
to the keys of chunks c - L .. c as a [C, (L + 1) C] block (one window mask, one far mask on
t - s, both built once) and reads S_{c - L}, the linear state of every key before chunk c - L:

    S_{j+1} = exp(B_j - B_{j+1}) S_j + sum_{s in chunk j} exp(kls_s - B_{j+1}) kf_s v_s^T
    w_ts    = exp(A_ts - m_t) G_ts,  A = q.k / sqrt d (window) | qls_t + kls_s (far), G = 1 | qf_t . kf_s
    n_t     = sum_{s in block} w_ts v_s + exp(qls_t + B_{c-L} - m_t) qf_t S_{c-L}

The Function picks its own chunk, C / 2^k (``_inner_chunk``: at C = 64, 16 for W <= 32 and 32 for
W <= 64), where narrower blocks cost less than the extra chunks. Per group of chunks: the window
logits q.k / sqrt d on the whole [C, (L + 1) C] block with an additive -inf mask, the far field
exp(qls_t + kls_s - m_t) (qf_t . kf_s) on its first R_f = L C - W + C columns only (the keys that
can be far), one weight block W (the two have disjoint supports), one W v matmul. With one group
(short sequences) the key blocks are views of one flat copy of the keys of every head behind
L C fill rows (a head's first blocks reach into the previous head's last keys; the masks zero
them), so the matmuls take them without a gather and the backward's block gradients go back with
one add per chunk of the block, not a scatter.

Memory: the forward keeps its inputs (aligned q, k, features, log-scales, v), the stabiliser m
[T] and the state before each group of chunks; every [C, (L + 1) C] temporary lives for one group
(~1M elements). Up to ``_KEEP_ELEMENTS`` block elements in all (short sequences, a long one's
segments) it also keeps each group's record (``_Group``: weights, states read, scaled keys) and
the backward recomputes nothing; beyond, the backward recomputes a group's blocks and states from
those (one extra q.k / qf.kf matmul pair per group), walking the groups in reverse with dL/dS
carried between them:

    dw = dn v^T,  Z = dw * w:   dlogits = Z (window),  dqls_t / dkls_s = sum Z (far)
    dG = dw * exp(A - m) (far):  dqf = dG kf,  dkf = dG^T qf
    dS_{c-L} += qf^T (c_t dn_t),  dU_j = dS_{j+1},  dS_j = exp(B_j - B_{j+1}) dS_{j+1} + reads
    dkf_s, dv_s, dkls_s from dU_j as in ``linear/chunk.py``; m and B are detached (no gradient).

The values are any columns: with a ones column last (and k_sum last in s0) the numerators carry
the denominators; "rms" (which reads none) passes v and kv alone, so every value-side matmul is
Dv wide. ``normalize.normalize_numerators`` applies the output normalisation with its hand-written
backward.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch


# elements of a group's [heads, g, C, (L + 1) C] temporaries (x 4 bytes = 4 MiB)
_GROUP_ELEMENTS = 1 << 20
# up to this many block elements in all (short sequences, a long one's segments), the forward keeps
# the block weights for the backward instead of recomputing them (two matmuls and ~6 elementwise passes)
_KEEP_ELEMENTS = 1 << 22
# the Function runs chunks of C / 2^k >= this many queries where that narrows the [C, (L + 1) C] blocks
_MIN_CHUNK = 16


def _inner_chunk(c: int, window: int) -> int:
    """The chunk the Function runs: C halved while the half is >= ``_MIN_CHUNK``, still covers the window
    in at most two chunks (L <= 2) and shrinks the (L + 1) C keys of a query's block (at C = 64:
    W = 16 runs chunks of 16, 32 keys per query instead of 128; W = 64 chunks of 32, 96 keys).
    Any divisor of C gives the same numerators to rounding (T stays a multiple of it); the
    per-query state read and key increments cost the same at any C, and below L <= 2 more, smaller
    chunks cost more in per-chunk steps and small matmuls than their narrower blocks save (CPU)."""
    def keys(chunk: int) -> int:
        return (-(-window // chunk) + 1) * chunk

    while c % 2 == 0 and c // 2 >= max(_MIN_CHUNK, -(-window // 2)) and keys(c // 2) < keys(c):
        c //= 2
    return c


@functools.lru_cache(maxsize=32)
def block_masks(c: int, lookback: int, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, (L + 1) C] bool (near, far-within-block) for query i of a chunk and key j of its block
    (chunks c - L .. c): t - s = i - j + L C."""
    lag = torch.arange(c, device=device).unsqueeze(1) - torch.arange((lookback + 1) * c, device=device) + lookback * c
    return (lag >= 0) & (lag < window), lag >= window


@functools.lru_cache(maxsize=64)
def _biases(
    c: int, lookback: int, window: int, far_cols: int, c0: int, g: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks (0 where the entry counts, -inf elsewhere) of chunks c0 .. c0 + g - 1: the window
    [C, (L + 1) C] and the far field on the first ``far_cols`` columns [C, R], or [g, C, *] when a
    block reaches before the first key (those columns never count, whatever they hold)."""
    near, far = block_masks(c, lookback, window, device)
    far = far[:, :far_cols]
    if c0 < lookback:
        first_key = (lookback - c0 - torch.arange(g, device=device)) * c  # block column of the head's key 0
        real = (torch.arange((lookback + 1) * c, device=device) >= first_key.unsqueeze(-1)).unsqueeze(1)
        near, far = near & real, far & real[..., :far_cols]

    def bias(mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(mask.shape, device=device, dtype=dtype).masked_fill_(~mask, float("-inf"))

    return bias(near), bias(far)


class _Plan:
    """Sizes and the far-field stabiliser pieces shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, kls: torch.Tensor, m0: torch.Tensor, window: int, c: int) -> None:
        bh, t_pad, _ = q.shape
        self.bh, self.c, self.window, self.chunks = bh, c, window, t_pad // c
        self.lookback = min(-(-window // c), self.chunks - 1)
        self.device, self.dtype = q.device, q.dtype
        per_chunk = bh * c * (self.lookback + 1) * c
        self.per_group = max(1, _GROUP_ELEMENTS // per_chunk)
        self.keep = per_chunk * self.chunks <= _KEEP_ELEMENTS
        # far keys are s <= t - W: only the block's first L C - W + C keys can be (for W = L C: the
        # chunk c - L alone), so the feature products qf . kf cover those columns only
        self.far_cols = max(0, min((self.lookback + 1) * c, self.lookback * c - window + c))
        kls = kls.detach()
        # B_0 = m0, B_{j+1} = max(B_j, max kls of chunk j); decay_j = exp(B_j - B_{j+1}) (0 for empty states)
        ends = kls.view(bh, self.chunks, c).amax(-1)
        self.bounds = torch.cat([m0.unsqueeze(-1), torch.maximum(ends.cummax(-1).values, m0.unsqueeze(-1))], dim=-1)
        self.decay = torch.exp(self.bounds[:, :-1] - self.bounds[:, 1:]).nan_to_num_(0.0)
        # exp(kls_s - B_{j+1}) for key s of chunk j (nan for an all -inf prefix: no far field there)
        self.key_scale = torch.exp(kls.view(bh, self.chunks, c) - self.bounds[:, 1:, None]).nan_to_num_(0.0).view(bh, t_pad)
        # the far field's max log-scale for query t: max(m0, max_{s <= t - W} kls_s)
        running = torch.maximum(kls.cummax(-1).values, m0.unsqueeze(-1))
        shifted = torch.cat([m0.unsqueeze(-1).expand(bh, min(window, t_pad)), running], dim=-1)
        self.far_max = shifted[:, :t_pad]

    def groups(self) -> list[tuple[int, int]]:
        return [(c0, min(self.per_group, self.chunks - c0)) for c0 in range(0, self.chunks, self.per_group)]

    def biases(self, c0: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _biases(self.c, self.lookback, self.window, self.far_cols, c0, g, self.device, self.dtype)

    def state_range(self, c0: int, g: int) -> tuple[int, int, int]:
        """(first read state index a = c0 - L, first and end chunk whose increments the group absorbs)."""
        a = c0 - self.lookback
        return a, max(a, 0), max(a + g, 0)

    def key_blocks(self, x: torch.Tensor, c0: int, g: int, fill: float) -> torch.Tensor:
        """Keys x [BH, T, *] -> chunk c0 + i's block (chunks c0 + i - L .. c0 + i) for i < g:
        [BH, g, (L + 1) C, *]. One group (short sequences): a view of the flattened keys of all heads
        behind L C ``fill`` rows, so a head's first blocks start in the previous head's last keys
        (masked by the biases) and the matmuls take every block without a gather copy. Several
        groups: a view of the group's keys (``fill`` before the first key)."""
        c, lb = self.c, self.lookback
        width = (lb + 1) * c
        if g == self.chunks:
            flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
            flat = torch.cat([flat.new_full((lb * c, *flat.shape[1:]), fill), flat]) if lb else flat
            blocks = flat.unfold(0, width, c)  # [BH nC, *, R]
            blocks = blocks.movedim(-1, 1) if x.dim() == 3 else blocks
            return blocks.view(x.shape[0], g, width, *x.shape[2:])
        lo, hi = (c0 - lb) * c, (c0 + g) * c
        part = x[:, max(lo, 0) : hi]
        if lo < 0:
            part = torch.cat([part.new_full((part.shape[0], -lo, *part.shape[2:]), fill), part], dim=1)
        blocks = part.unfold(1, width, c)  # [BH, g, *, R]
        return blocks.movedim(-1, 2) if x.dim() == 3 else blocks

    def block_grads(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A gradient of keys ``like`` [BH, T, *] as (grad, store): ``scatter`` adds block gradients
        into ``store``, whose rows are grad's behind L C spare rows (the one-group layout of
        ``key_blocks``: a block's columns before its head's first key land there or in the previous
        head's rows, as exact zeros). Zeros with several groups; with one, the single ``scatter``
        writes every row (its first part by a copy, not an add to zeros)."""
        spare = self.lookback * self.c
        rows = spare + like.shape[0] * like.shape[1]
        one = len(self.groups()) == 1
        store = like.new_empty(rows, *like.shape[2:]) if one else like.new_zeros(rows, *like.shape[2:])
        return store[spare:].view(like.shape), store

    def scatter(self, grad: torch.Tensor, store: torch.Tensor, blocks: torch.Tensor, c0: int, g: int) -> None:
        """grad [BH, T, *] (``store`` its ``block_grads`` storage) += the block gradients [BH, g, R', *]
        (the first R' <= (L + 1) C keys of each block) of chunks c0 .. c0 + g - 1; with one group
        (called once per store), grad = them."""
        c, lb = self.c, self.lookback
        bh, rows = blocks.shape[0], blocks.shape[2]
        if store.numel() == 0:  # zero-width keys (no far field: F = 0)
            return
        if g == self.chunks:
            chunks = store.view(-1, c, *store.shape[1:])  # [L + BH nC, C, *]
            flat = blocks.reshape(bh * g, rows, *blocks.shape[3:])
            n = bh * g
            if rows == 0:  # no far columns: nothing to add
                store.zero_()
            for part in range(-(-rows // c)):
                width = min(c, rows - part * c)
                if part == 0:  # the chunks part 0 does not cover (its rows past width, the last L) start at 0
                    if width < c:
                        chunks[:n, width:].zero_()
                    chunks[n:].zero_()
                    chunks[:n, :width].copy_(flat[:, :width])
                else:
                    chunks[part : part + n, :width].add_(flat[:, part * c : part * c + width])
            return
        chunked = grad.view(bh, grad.shape[1] // c, c, *grad.shape[2:])
        for part in range(-(-rows // c)):
            first = c0 - lb + part  # the chunk that block i's part ``part`` covers is first + i
            skip, width = max(-first, 0), min(c, rows - part * c)
            if skip < g:
                chunked[:, first + skip : first + g, :width].add_(blocks[:, skip:, part * c : part * c + width])


class _Group(NamedTuple):
    """Everything the backward needs of chunks c0 .. c0 + g - 1 (kept by the forward, or recomputed)."""

    qg: torch.Tensor  # q / sqrt d [BH, g, C, d]
    qfg: torch.Tensor  # [BH, g, C, F]
    qlsg: torch.Tensor  # [BH, g, C]
    kb: torch.Tensor  # key blocks [BH, g, R, d] (R = (L + 1) C)
    kfb: torch.Tensor  # their features on the far columns [BH, g, R_f, F]
    vb: torch.Tensor  # value blocks [BH, g, R, Dv']
    w: torch.Tensor  # weights [BH, g, C, R]: the window's and the far field's, 0 elsewhere
    x: torch.Tensor  # exp(qls_t + kls_s - m_t) on far entries, 0 elsewhere [BH, g, C, R_f]
    w_far: torch.Tensor  # x (qf . kf) [BH, g, C, R_f]
    m: torch.Tensor  # the stabiliser [BH, g, C]
    reads: torch.Tensor  # S_{max(c - L, 0)} per chunk [BH, g, F, Dv']
    y: torch.Tensor  # qf_t S_{c - L} [BH, g, C, Dv']
    carried: torch.Tensor  # exp(qls_t + B_{c - L} - m_t) [BH, g, C]
    kw: torch.Tensor  # the absorbed chunks' scaled key features [BH, hi - lo, C, F]


def _group(
    plan: _Plan, q, qf, qls, k, kf, kls, v_aug, start: torch.Tensor, m, c0: int, g: int, scale: float,
) -> tuple[_Group, torch.Tensor]:  # fmt: skip
    """Chunks c0 .. c0 + g - 1 from the state before them: their ``_Group`` and the state after them.
    ``m`` None: the stabiliser is computed here (the forward), else read from m [BH, T]."""
    bh, c, fc = q.shape[0], plan.c, plan.far_cols
    a, lo, hi = plan.state_range(c0, g)
    rows = slice(c0 * c, (c0 + g) * c)
    # the states read: S_{j+1} = decay_j S_j + U_j, U_j = kw_j^T v_j for the chunks the group absorbs
    keys = slice(lo * c, hi * c)
    kw = kf[:, keys].view(bh, hi - lo, c, kf.shape[-1]) * plan.key_scale[:, keys].view(bh, hi - lo, c, 1)
    increments = kw.transpose(-1, -2) @ v_aug[:, keys].view(bh, hi - lo, c, v_aug.shape[-1])
    reads = start.new_empty(bh, g, *start.shape[1:])
    reads[:, 0] = start
    for i in range(g):  # each state straight into its slot: one op per chunk
        after = reads[:, i + 1] if i + 1 < g else None
        if a + i < 0:  # chunk i reads the state before the first key, and so does chunk i + 1
            state = reads[:, i] if after is None else after.copy_(reads[:, i])
        else:
            state = torch.addcmul(increments[:, a + i - lo], reads[:, i], plan.decay[:, a + i, None, None], out=after)
    qg, qfg, qlsg = q[:, rows].view(bh, g, c, q.shape[-1]), qf[:, rows].view(bh, g, c, qf.shape[-1]), qls[:, rows].view(bh, g, c)
    kb, kfb = plan.key_blocks(k, c0, g, 0.0), plan.key_blocks(kf, c0, g, 0.0)[:, :, :fc]
    qg = qg * scale
    near_bias, far_bias = plan.biases(c0, g)
    w = torch.matmul(qg, kb.transpose(-1, -2)).add_(near_bias)  # window logits, -inf elsewhere
    if m is None:
        # far entries qls_t + kls_s are <= qls_t + far_max_t: the row max is the window's or below
        m = torch.maximum(w.amax(-1), qlsg.detach() + plan.far_max[:, rows].view(bh, g, c))
        m = m.nan_to_num_(neginf=0.0)  # a row that sees nothing (-inf): weights 0 anyway
    else:
        m = m[:, rows].view(bh, g, c)
    w = w.sub_(m.unsqueeze(-1)).exp_()
    klsb = plan.key_blocks(kls, c0, g, float("-inf"))[..., :fc]  # [BH, g, R_f]
    x = torch.add((qlsg - m).unsqueeze(-1), klsb.unsqueeze(-2)).add_(far_bias).exp_()
    w_far = torch.matmul(qfg, kfb.transpose(-1, -2)).mul_(x)
    w[..., :fc].add_(w_far)  # disjoint supports: each entry is the window's or the far field's weight
    # exp(qls_t + B_{max(c - L, 0)} - m_t) (0 for an empty state)
    index = torch.clamp(torch.arange(a, a + g, device=q.device), min=0)
    carried = torch.exp(qlsg + plan.bounds.index_select(1, index).unsqueeze(-1) - m).nan_to_num_(0.0)
    vb = plan.key_blocks(v_aug, c0, g, 0.0)
    return _Group(qg, qfg, qlsg, kb, kfb, vb, w, x, w_far, m, reads, qfg @ reads, carried, kw), state


class ChunkedWindowNumerator(torch.autograd.Function):
    """(q, qf, qls, k, kf, kls, v_aug [BH, T, *] key-aligned, T a multiple of C, padded keys with
    k = kf = v_aug = 0 and kls = -inf; s0 [BH, F, Dv'], m0 [BH]; window, C) -> numerators [BH, T, Dv']:
    v_aug's columns are any values (a ones column last gives the denominator, s0's k_sum column)."""

    @staticmethod
    def forward(ctx, q, qf, qls, k, kf, kls, v_aug, s0, m0, window, c):  # type: ignore[override]
        c = _inner_chunk(c, window)
        plan = _Plan(q, kls, m0, window, c)
        scale = 1.0 / math.sqrt(q.shape[-1])
        bh, t_pad = q.shape[:2]
        numer = v_aug.new_empty(bh, t_pad, v_aug.shape[-1])
        m_all = q.new_empty(bh, t_pad)
        starts, state, kept = [], s0, []
        for c0, g in plan.groups():
            starts.append(state)
            grp, state = _group(plan, q, qf, qls, k, kf, kls, v_aug, state, None, c0, g, scale)
            rows = slice(c0 * c, (c0 + g) * c)
            m_all[:, rows] = grp.m.reshape(bh, -1)
            out = numer[:, rows].view(bh, g, c, v_aug.shape[-1])
            torch.matmul(grp.w, grp.vb, out=out)
            out.addcmul_(grp.carried.unsqueeze(-1), grp.y)
            if plan.keep:
                kept += list(grp)
        ctx.save_for_backward(q, qf, qls, k, kf, kls, v_aug, s0, m_all, torch.stack(starts, dim=1), *kept)
        ctx.meta = (window, c, s0.requires_grad)
        ctx.plan = plan  # its tensors derive from detached kls, m0: the backward reuses them
        return numer

    @staticmethod
    def backward(ctx, d_numer):  # type: ignore[override]
        q, qf, qls, k, kf, kls, v_aug, s0, m_all, starts, *kept = ctx.saved_tensors
        window, c, needs_s0 = ctx.meta
        plan = ctx.plan
        scale = 1.0 / math.sqrt(q.shape[-1])
        bh = q.shape[0]
        d_numer = d_numer.contiguous()
        dq, dqf, dqls = torch.empty_like(q), torch.empty_like(qf), torch.empty_like(qls)  # every row written once
        (dk, dk_store), (dkf, dkf_store), (dkls, dkls_store), (dv, dv_store) = (plan.block_grads(t) for t in (k, kf, kls, v_aug))
        carry = torch.zeros_like(s0)  # dL/dS at the end of the group being walked
        fields = len(_Group._fields)
        for gi, (c0, g) in reversed(list(enumerate(plan.groups()))):
            a, lo, hi = plan.state_range(c0, g)
            if kept:
                grp = _Group(*kept[fields * gi : fields * (gi + 1)])
            else:
                grp, _ = _group(plan, q, qf, qls, k, kf, kls, v_aug, starts[:, gi], m_all, c0, g, scale)
            rows = slice(c0 * c, (c0 + g) * c)
            dn = d_numer[:, rows].view(bh, g, c, v_aug.shape[-1])
            dw = torch.matmul(dn, grp.vb.transpose(-1, -2))
            fc = grp.w_far.shape[-1]
            d_gram = dw[..., :fc] * grp.x  # dL/d(qf . kf) on far entries
            z_far = dw[..., :fc] * grp.w_far  # dL/d(qls_t + kls_s) on far entries
            plan.scatter(dv, dv_store, grp.w.transpose(-1, -2) @ dn, c0, g)
            z = dw.mul_(grp.w)
            z[..., :fc].sub_(z_far)  # dL/dlogits: window entries only (exact zeros elsewhere)
            torch.matmul(z, grp.kb, out=dq[:, rows].view(bh, g, c, q.shape[-1])).mul_(scale)
            plan.scatter(dk, dk_store, z.transpose(-1, -2) @ grp.qg, c0, g)  # qg: q / sqrt d
            dqf_g = torch.matmul(d_gram, grp.kfb, out=dqf[:, rows].view(bh, g, c, qf.shape[-1]))
            plan.scatter(dkf, dkf_store, d_gram.transpose(-1, -2) @ grp.qfg, c0, g)
            dqls_g = z_far.sum(-1)
            plan.scatter(dkls.unsqueeze(-1), dkls_store.unsqueeze(-1), z_far.sum(-2).unsqueeze(-1), c0, g)
            # the carried state: n_t += c_t qf_t S_{c - L}
            dqls_g += grp.carried * (dn * grp.y).sum(-1)
            dn_c = dn * grp.carried.unsqueeze(-1)
            dqf_g.add_(dn_c @ grp.reads.transpose(-1, -2))
            d_reads = grp.qfg.transpose(-1, -2) @ dn_c  # [BH, g, F, Dv']
            dqls[:, rows] = dqls_g.view(bh, g * c)
            # reverse scan over the states the group read and the chunks it absorbed: dU_{a + i} (the
            # carry before chunk i's read is added) overwrites d_reads[:, i] once that is read, so dU is
            # d_reads[:, lo - a :] (chunks lo .. hi - 1), not another [BH, g, F, Dv'] tensor (the peak)
            for i in reversed(range(g)):
                if a + i >= 0:
                    carry, d_reads[:, i] = torch.addcmul(d_reads[:, i], carry, plan.decay[:, a + i, None, None]), carry
                else:
                    carry = carry + d_reads[:, i]
            if hi > lo:  # U_j = kw_j^T v_j, kw = kf * key_scale
                keys, skip = slice(lo * c, hi * c), lo - a
                v_chunks = v_aug[:, keys].view(bh, hi - lo, c, v_aug.shape[-1])
                kw = grp.kw
                if skip:  # zero chunks in front: the matmuls take d_reads whole (a slice of it would be copied)
                    v_chunks = torch.cat([v_chunks.new_zeros(bh, skip, *v_chunks.shape[2:]), v_chunks], dim=1)
                    kw = torch.cat([kw.new_zeros(bh, skip, *kw.shape[2:]), kw], dim=1)
                d_kw = (v_chunks @ d_reads.transpose(-1, -2))[:, skip:]  # [BH, n, C, F]
                dv[:, keys] += (kw @ d_reads)[:, skip:].reshape(bh, (hi - lo) * c, v_aug.shape[-1])
                key_scale = plan.key_scale[:, keys].view(bh, hi - lo, c, 1)
                dkf[:, keys] += (d_kw * key_scale).view(bh, (hi - lo) * c, kf.shape[-1])
                dkls[:, keys] += (d_kw * grp.kw).sum(-1).view(bh, (hi - lo) * c)
        d_s0 = carry if needs_s0 else None
        return dq, dqf, dqls, dk, dkf, dkls, dv, d_s0, None, None, None
