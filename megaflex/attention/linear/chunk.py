"""Chunked causal linear attention: the training fast path, with a hand-written backward.

Same maths as the quadratic and recurrent forms (see ``core.py``): for token t in chunk c
(chunks of C tokens, the last one possibly shorter), with the per-token stabiliser
m_t = max(state.log_max, max_{s<=t} kls_s) (detached) and M_c = m at the end of chunk c,

    S_c   = exp(M_{c-1} - M_c) S_{c-1} + sum_{s in c} exp(kls_s - M_c) kf_s v_s^T     (chunk states)
    n_t   = sum_{s in c, s<=t} (qf_t . kf_s) exp(kls_s - m_t) v_s                    (intra-chunk, C x C)
          + exp(M_{c-1} - m_t) qf_t S_{c-1}                                         (inter-chunk)

Every exp argument is <= 0, so nothing overflows whatever the key norms. The denominator
d_t is the same sum with v_s := 1, so we append a ones column to v ("v_aug" [.., Dv + 1]): the
last column of the numerator is d_t and the last column of the state is k_sum. One code path
then serves both normalisations and returns the full state.

Performance design (CPU; the optional fused GPU backend is ``chunk_fla.py``):

* All compute in fp32 (fp64 for fp64 inputs) with autocast off, whatever the input dtype.
* One sweep per head over *groups* of G chunks (forward in order, backward in reverse): chunk
  increments, the O(F Dv)-per-chunk state scan and the chunk outputs of a group share hot data,
  and every temporary (C x C weights, scaled keys, ...) is ~1 MiB, so it stays in cache and the
  allocator reuses it. Within a group all chunks go through one batched ``bmm``/``baddbmm``
  into preallocated outputs; Python loops only over groups and the tiny per-chunk scan adds.
* Short N (a head's tokens x max(C, F) under ``_HEAD_BLOCK_ELEMENTS``): a block of heads goes
  through the same calls together, all its chunks in one group (N padded to whole chunks with
  zero keys and values and log-scale -inf, which reach no real token and not the state), so the
  per-call overhead is paid per block, not per (batch x head) pair.
* Fast path: exp(kls_s - m_t) = exp(kls_s - M_c) exp(M_c - m_t) (key scale <= 1, row scale
  <= e^_FAST_RANGE while the running max rises little inside the chunk, the common case), so
  the C x C weights are one masked matmul of pre-scaled keys. Chunks with bigger jumps build the
  exact C x C factor (``_decay_weights``). Both are exact; the choice is made per group.
* The output normalisation is fused (per group, reusing ``normalize_output``), so no full-size
  normalisation temporaries exist; the fp32 numerators (n_aug for "denominator") are saved for
  its backward. "rms" skips the denominator column in every output-side matmul.
* Backward recomputes the C x C weights from q, k (one bmm + a mask), and each group's chunk
  states S_c from the state before the group (one bmm + the scan): the forward keeps only
  those group-boundary states. Gradients (exact-path notation; the fast path is the
  same algebra with the factorised weights):

      dW'_ts = (dn_t . v_s) exp(kls_s - m_t)            (masked, s <= t)
      dq     = dW' K + exp(M_{c-1} - m_t) dn S_{c-1}^T
      dk     = dW'^T Q + exp(kls_s - M_c) V dS_c^T,      dv = W^T dn + exp(kls_s - M_c) K dS_c
      dS_c   = exp(M_c - M_{c+1}) dS_{c+1} + sum_{t in c+1} exp(M_c - m_t) qf_t dn_t^T  (reverse scan)
      dkls_s = kf_s . dk_s        (every path of kls_s into the output is exp(kls_s - .) kf_s)

  The gradient of the returned state seeds the reverse scan, so truncated BPTT through
  carried states works; the initial state gets kv/k_sum gradients. Its log_max, like every
  stabiliser, is a constant for autograd (as in the quadratic and recurrent forms).
* Backward keeps only a per-head buffer of one group's states and state
  gradients (dL/dS at a group boundary is carried to the previous group).
* One group's work is ``group_forward`` / ``group_backward``, shared with ``chunk_trig.py``,
  which feeds them trig features computed per group on the fly (nothing [B, H, N, F] is saved).
* PyTorch's CPU allocator does not cache: with glibc defaults every > 32 MiB tensor is a fresh
  mmap that page-faults again each step. Set ``MALLOC_MMAP_MAX_=0`` and a large
  ``MALLOC_TRIM_THRESHOLD_`` (or use jemalloc/tcmalloc) for long sequences: ~2x at 16k tokens;
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (transparent huge pages) saves another ~8% at 64k.
"""

from __future__ import annotations

import functools

import torch

from ..base import LinearAttentionState, fp32_inputs
from ..decay import folded
from ..heads import for_each_head
from ..inputs import validate_linear_attention_inputs
from ..normalize import normalize_backward, normalize_output, reads_denominator

# target number of elements of a group's C x C weight block (x 4 bytes = 1 MiB)
_GROUP_ELEMENTS = 1 << 18
# target number of elements of a head block's temporaries (short N: several heads per batched call)
_HEAD_BLOCK_ELEMENTS = 1 << 17
# a chunk whose running max rises by at most this much (within the chunk) takes the fast path
_FAST_RANGE = 20.0


@functools.lru_cache(maxsize=32)
def _future_mask(c: int, device: torch.device) -> torch.Tensor:
    """[c, c] bool, True where s > t (key after query): those weights are zero."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1)


Group = tuple[slice, int, int, int]  # (token slice, chunks g, chunk length, first chunk)


def chunk_groups(n: int, c: int, max_dim: int) -> list[Group]:
    """Split N tokens into groups of whole chunks: (token slice, chunks g, chunk length, first chunk).

    Full chunks are grouped so that a group's largest temporary (g x C x max(C, F)) is about
    ``_GROUP_ELEMENTS``; a shorter last chunk (N not a multiple of C) forms its own group.
    """
    full = n // c
    per_group = max(1, _GROUP_ELEMENTS // (c * max(c, max_dim)))
    groups = []
    for first in range(0, full, per_group):
        g = min(per_group, full - first)
        groups.append((slice(first * c, (first + g) * c), g, c, first))
    if n % c:
        groups.append((slice(full * c, n), 1, n % c, full))
    return groups


def _head_blocks(bh: int, n: int, c: int, max_dim: int, device: torch.device) -> list[slice]:
    """Heads processed together: one head at a time for long N; for short N as many heads as fit
    ``_HEAD_BLOCK_ELEMENTS`` (all their chunks in one group), but at least one block per thread."""
    per_head = -(-n // c) * c * max(c, max_dim)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    size = max(1, min(_HEAD_BLOCK_ELEMENTS // per_head, -(-bh // threads)))
    return [slice(h, min(h + size, bh)) for h in range(0, bh, size)]


def plan_blocks(bh: int, n: int, c: int, max_dim: int, device: torch.device) -> tuple[list[slice], list[Group], int]:
    """(head blocks, chunk groups, padded N). Head blocks of several heads take all chunks in one
    group, so every [heads, tokens, ...] slice is one batched ``bmm`` operand; N is then padded to
    a multiple of C (zero keys and values, log-scale -inf: nothing reaches a real token or the state)."""
    blocks = _head_blocks(bh, n, c, max_dim, device)
    if len(blocks) == bh:
        return blocks, chunk_groups(n, c, max_dim), n
    n_pad = -(-n // c) * c
    return blocks, [(slice(0, n_pad), n_pad // c, c, 0)], n_pad


_plan = plan_blocks  # the old name, which tests/attention/test_attention_head_blocks.py still calls


def _pad_tokens(t: torch.Tensor, n_pad: int, value: float = 0.0) -> torch.Tensor:
    """t [BH, N, ...] padded along N to n_pad with ``value`` (t itself when N == n_pad)."""
    n = t.shape[1]
    if n == n_pad:
        return t
    out = t.new_full((t.shape[0], n_pad, *t.shape[2:]), value)
    out[:, :n] = t
    return out


def _bmm_into(a: torch.Tensor, b: torch.Tensor, dest: torch.Tensor) -> None:
    """dest [nh, g, ...] = bmm(a, b) viewed as dest's shape (a, b batched as nh * g or nh): straight
    into dest when it is one head's (a contiguous view), else through a temporary (a block's slice
    of chunk states [:, j0 : j0 + g] does not flatten to a view)."""
    if dest.shape[0] == 1:
        torch.bmm(a, b, out=dest[0].view(-1, a.shape[1], b.shape[2]))
    else:
        dest.copy_(torch.bmm(a, b).view(dest.shape))


class GroupScratch:
    """Per-thread buffers of one head block's chunk-group sweep, [nh, most + 1, F, Dv+1] each: ``u``
    (scan inputs: chunk increments, or local state gradients), ``s`` (chunk states) and, for
    the backward, ``ds`` (state gradients). Index j is chunk c0 + j of the current group."""

    def __init__(self, nh: int, most: int, feat: int, dva: int, like: torch.Tensor, backward: bool) -> None:
        self.u = like.new_empty(nh, most + 1, feat, dva)
        self.s = like.new_empty(nh, most + 1, feat, dva)
        self.ds = like.new_empty(nh, most + 1, feat, dva) if backward else None


def _scan_forward(u: torch.Tensor, dec: torch.Tensor, s: torch.Tensor) -> None:
    """Chunk states S_j = d_j S_{j-1} + U_j, j = 1..g, into s [nh, >= g+1, F, Dv+1] from u[:, 0] = S_0
    and u[:, j] = U_j; dec [nh, g, 1, 1] the chunk decays d_j = exp(b_{j-1} - b_j)."""
    s[:, 0] = u[:, 0]
    for j in range(dec.shape[1]):
        torch.addcmul(u[:, j + 1], s[:, j], dec[:, j], out=s[:, j + 1])


def _scan_backward(u: torch.Tensor, dec: torch.Tensor, ds: torch.Tensor) -> None:
    """The reverse scan dS_j = G_j + d_{j+1} dS_{j+1} into ds[:, 0..g] from u[:, j] = G_j (j < g, the
    local gradients) and u[:, g] = dS_g; dec [nh, g, 1, 1] as in ``_scan_forward``."""
    g = dec.shape[1]
    ds[:, g] = u[:, g]
    for j in range(g - 1, -1, -1):
        torch.addcmul(u[:, j], ds[:, j + 1], dec[:, j], out=ds[:, j])


def _group_states(kw: torch.Tensor, vg: torch.Tensor, start: torch.Tensor, dec: torch.Tensor, buf: GroupScratch) -> None:
    """A group's chunk states into buf.s [nh, >= g+1, F, Dv+1]: buf.s[:, 0] = start (the state before
    the group), S_c = d_c S_{c-1} + U_c with U_c = sum_s kw_s v_s^T; kw, vg [nh g, C, .], dec [nh, g, 1, 1]."""
    g = dec.shape[1]
    buf.u[:, 0] = start
    _bmm_into(kw.transpose(1, 2), vg, buf.u[:, 1 : g + 1])
    _scan_forward(buf.u, dec, buf.s)


def _decay_weights(lam: torch.Tensor, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """E_ts = exp(kls_s - m_t) for s <= t, else 0: lam, m [g, c] -> [g, c(t), c(s)]."""
    e = lam.unsqueeze(-2) - m.unsqueeze(-1)
    # mask *before* exp: a later key can have kls_s > m_t, whose exp could overflow
    return e.masked_fill_(mask, float("-inf")).exp_()


def chunk_stabiliser(lam: torch.Tensor, m0: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Running max m [BH, N], chunk boundaries M [BH, L+1] (M_0 = m0), per-chunk decays
    exp(M_{c-1} - M_c) [BH, L] and fast-path flags (running max rises <= _FAST_RANGE inside the chunk)."""
    n = lam.shape[-1]
    m = torch.maximum(lam.cummax(dim=-1).values, m0.unsqueeze(-1))  # [BH, N], detached by construction
    starts = torch.arange(0, n, c, device=lam.device)
    ends = torch.clamp(starts + c, max=n) - 1
    bounds = torch.cat([m0.unsqueeze(-1), m[:, ends]], dim=-1)  # [BH, L+1]
    # nan only for an all -inf prefix (-inf - -inf): such a state is empty, decay it to 0
    decay = torch.exp(bounds[:, :-1] - bounds[:, 1:]).nan_to_num_(0.0)
    fast = (bounds[:, 1:] - m[:, starts]) <= _FAST_RANGE
    return m, bounds, decay, fast.tolist()


def _all_fast(fast: list, hb: slice, c0: int, g: int) -> bool:
    return all(all(fast[h][c0 : c0 + g]) for h in range(hb.start, hb.stop))


def group_forward(
    qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, lg: torch.Tensor, mg: torch.Tensor, bounds: torch.Tensor,
    start: torch.Tensor, dec: torch.Tensor, fast: bool, buf: GroupScratch, ng: torch.Tensor,
    q_scale: float = 1.0, k_scale: float = 1.0,
) -> None:  # fmt: skip
    """One chunk group of the forward (see ``_ChunkedLinearAttention``): its chunk states into buf.s
    [nh, >= g+1, F, Dv+1] (buf.s[:, 0] = start) and its fp32 numerators into ng [nh g, cl, nc].

    qg, kg [nh g, cl, F], vg [nh g, cl, Dv+1] (ones column last), lg, mg [nh g, cl] key log-scales
    and running max, bounds [nh, g+1] the chunk-boundary maxima M_{c0 .. c0+g}, dec [nh, g, 1, 1]
    the chunk decays; ``fast``: every chunk of the group may take the factorised path. The
    features are q_scale qg and k_scale kg: constant scales ride on the per-row factors for free.
    """
    nh, g = dec.shape[:2]
    cl, feat, nc = qg.shape[1], qg.shape[2], ng.shape[-1]
    m_prev, m_end = bounds[:, :g].reshape(nh * g, 1), bounds[:, 1:].reshape(nh * g, 1)
    kw = kg * torch.exp(lg - m_end).mul_(k_scale).unsqueeze(-1)  # key features scaled to the chunk's end max
    # chunk increments U_c = sum_s exp(kls_s - M_c) k_s v_s^T, then the scan S_c = d_c S_{c-1} + U_c
    _group_states(kw, vg, start, dec, buf)
    torch.bmm(qg, buf.s[:, :g, :, :nc].reshape(nh * g, feat, nc), out=ng)  # inter-chunk: q_t S_{c-1}
    if fast:
        # n_t = exp(M_c - m_t) [exp(M_{c-1} - M_c) q_t S_{c-1} + sum_s (q_t . kw_s) v_s]
        ng.mul_(dec.reshape(nh * g, 1, 1))
        ng.baddbmm_(torch.bmm(qg, kw.transpose(1, 2)).tril_(), vg[..., :nc])
        ng.mul_(torch.exp(m_end - mg).mul_(q_scale).unsqueeze(-1))
    else:
        ng.mul_(torch.exp(m_prev - mg).mul_(q_scale).unsqueeze(-1))
        weights = torch.bmm(qg, kg.transpose(1, 2)).mul_(_decay_weights(lg, mg, _future_mask(cl, qg.device)))
        ng.baddbmm_(weights, vg[..., :nc], alpha=q_scale * k_scale)


def group_backward(
    qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, lg: torch.Tensor, mg: torch.Tensor, bounds: torch.Tensor,
    start: torch.Tensor, dec: torch.Tensor, fast: bool, dng: torch.Tensor, carry: torch.Tensor, buf: GroupScratch,
    dqg: torch.Tensor, dkg: torch.Tensor, dvg: torch.Tensor, d_lam_g: torch.Tensor,
    q_scale: float = 1.0, k_scale: float = 1.0,
) -> None:  # fmt: skip
    """One chunk group of the backward, inputs as in ``group_forward``; dng [nh g, cl, nc] the
    numerator gradients. Writes dqg, dkg [nh g, cl, F] (gradients w.r.t. qg and kg, so already
    multiplied by q_scale, k_scale), dvg [nh g, cl, Dv], d_lam_g [nh g, cl]; ``carry`` [nh, F, Dv+1]
    is dL/dS at the group's end on entry and at its start on return. ``buf`` (with ``ds``) is
    scratch for the recomputed states and their gradients."""
    nh, g = dec.shape[:2]
    cl, feat, nc, dva = qg.shape[1], qg.shape[2], dng.shape[-1], vg.shape[-1]
    dv = dva - 1
    m_prev, m_end = bounds[:, :g].reshape(nh * g, 1), bounds[:, 1:].reshape(nh * g, 1)
    # inter-chunk: n_t += exp(M_{c-1} - m_t) q_t S_{c-1}
    dn_inter = dng * torch.exp(m_prev - mg).mul_(q_scale).unsqueeze(-1)  # [nh g, cl, nc]
    local = buf.u[:, :g]  # dL/dS_c from the queries that read S_c, then the reverse scan
    buf.u[:, g] = carry
    if nc == dva:
        _bmm_into(qg.transpose(1, 2), dn_inter, local)
    else:  # "rms": the output does not depend on the k_sum column
        local[..., :nc] = torch.bmm(qg.transpose(1, 2), dn_inter).view(nh, g, feat, nc)
        local[..., nc:] = 0.0
    _scan_backward(buf.u, dec, buf.ds)
    carry.copy_(buf.ds[:, 0])
    d_u = buf.ds[:, 1 : g + 1].reshape(nh * g, feat, dva)  # dL/dS_c = dL/dU_c for this group's chunks
    key_scale = torch.exp(lg - m_end).mul_(k_scale).unsqueeze(-1)  # [nh g, cl, 1]
    kw = kg * key_scale
    _group_states(kw, vg, start, dec, buf)
    torch.bmm(dn_inter, buf.s[:, :g, :, :nc].reshape(nh * g, feat, nc).transpose(1, 2), out=dqg)
    if fast:
        dn_intra = dng * torch.exp(m_end - mg).mul_(q_scale).unsqueeze(-1)
        weights = torch.bmm(qg, kw.transpose(1, 2)).tril_()
        torch.bmm(weights.transpose(1, 2), dn_intra[..., :dv], out=dvg)
        d_w = torch.bmm(dn_intra, vg[..., :nc].transpose(1, 2)).tril_()
        dqg.baddbmm_(d_w, kw)
        torch.bmm(d_w.transpose(1, 2), qg, out=dkg)  # d(kw), scaled to dk below
        dkg.baddbmm_(vg, d_u.transpose(1, 2)).mul_(key_scale)
    else:
        e = _decay_weights(lg, mg, _future_mask(cl, qg.device)).mul_(q_scale * k_scale)
        weights = torch.bmm(qg, kg.transpose(1, 2)).mul_(e)
        torch.bmm(weights.transpose(1, 2), dng[..., :dv], out=dvg)
        d_w = torch.bmm(dng, vg[..., :nc].transpose(1, 2)).mul_(e)
        dqg.baddbmm_(d_w, kg)
        torch.bmm(d_w.transpose(1, 2), qg, out=dkg)
        dkg.baddbmm_(vg * key_scale, d_u.transpose(1, 2))
    dvg.baddbmm_(kw, d_u[..., :dv])
    # every path of kls_s is exp(kls_s - .) k_s, hence dkls_s = k_s . dk_s
    torch.sum(kg * dkg, dim=-1, out=d_lam_g)


class _ChunkedLinearAttention(torch.autograd.Function):
    """(q, k [BH, N, F], lam [BH, N], v [BH, N, Dv], s0 [BH, F, Dv+1], m0 [BH], ...)
    -> (out [BH, N, Dv] in ``out_dtype``, final state [BH, F, Dv+1], final log_max [BH]).

    One sweep over each head block's chunk groups, in order (forward) or reverse order
    (backward), so the state scan and the chunk work share hot data. A block is one head (long N)
    or several heads whose chunks all go through the same batched calls (short N, where per-call
    overhead would dominate). Per group, the *fast path* factorises
    exp(kls_s - m_t) = exp(kls_s - M_c) * exp(M_c - m_t) (key scale <= 1, row scale <= e^20 when
    the running max rises by <= _FAST_RANGE inside the chunk): the C x C weights are then a plain
    masked matmul of pre-scaled keys. Otherwise (huge log-scale jumps) the exact C x C factor
    exp(kls_s - m_t) is built. Both are exact; the fast path skips ~4 elementwise C x C passes.
    """

    @staticmethod
    def forward(ctx, q, k, lam, v, s0, m0, chunk_size, normalization, eps, out_dtype):  # type: ignore[override]
        bh, n, feat = q.shape
        dv = v.shape[-1]
        c = min(chunk_size, n)
        blocks, groups, n_pad = plan_blocks(bh, n, c, feat, q.device)
        q, k, lam = _pad_tokens(q, n_pad), _pad_tokens(k, n_pad), _pad_tokens(lam, n_pad, float("-inf"))
        v_aug = q.new_zeros(bh, n_pad, dv + 1)  # last column -> d_t, k_sum (0 on padding)
        v_aug[:, :n, :dv] = v
        v_aug[:, :n, dv] = 1.0
        m, bounds, decay, fast = chunk_stabiliser(lam, m0, c)

        # only the state before each group (and the final one) is kept: the backward recomputes a
        # group's chunk states from it (one bmm and the scan) instead of keeping all N / C of them
        states = q.new_empty(bh, len(groups) + 1, feat, dv + 1)
        states[:, 0] = s0
        most = max(g for _, g, _, _ in groups)
        # numerator columns actually needed: "rms" never reads the denominator, so its matmuls stay
        # Dv wide (64 columns run ~20% faster than 65 in MKL); the state always has the k_sum column
        nc = dv + 1 if reads_denominator(normalization) else dv
        numer = q.new_empty(bh, n_pad, nc)  # fp32 numerator (+ denominator), kept for backward
        out = torch.empty(bh, n_pad, dv, dtype=out_dtype, device=q.device)

        def forward_block(b: int) -> None:
            hb = blocks[b]
            nh = hb.stop - hb.start
            dec_b = decay[hb].view(nh, -1, 1, 1)
            buf = GroupScratch(nh, most, feat, dv + 1, q, backward=False)  # buf.s[:, j] = S_{c0 + j}
            for gi, (sl, g, cl, c0) in enumerate(groups):
                ng = numer[hb, sl].view(nh * g, cl, nc)
                group_forward(
                    q[hb, sl].reshape(nh * g, cl, feat), k[hb, sl].reshape(nh * g, cl, feat), v_aug[hb, sl].reshape(nh * g, cl, dv + 1),
                    lam[hb, sl].reshape(nh * g, cl), m[hb, sl].reshape(nh * g, cl), bounds[hb, c0 : c0 + g + 1],
                    states[hb, gi], dec_b[:, c0 : c0 + g], _all_fast(fast, hb, c0, g), buf, ng,
                )  # fmt: skip
                states[hb, gi + 1] = buf.s[:, g]
                den = ng[..., dv] if nc > dv else None
                out[hb, sl] = normalize_output(ng[..., :dv], den, normalization, eps).view(nh, g * cl, dv)

        for_each_head(forward_block, len(blocks), q.device)

        ctx.save_for_backward(q, k, lam, v_aug, s0, numer, m, bounds, states)
        ctx.meta = (c, n, blocks, groups, decay, fast, normalization, eps)
        log_max = bounds[:, -1].clone()
        ctx.mark_non_differentiable(log_max)
        out = out if n == n_pad else out[:, :n].contiguous()
        return out, states[:, -1].clone(), log_max

    @staticmethod
    def backward(ctx, d_out, d_final, _d_log_max):  # type: ignore[override]
        q, k, lam, v_aug, s0, numer, m, bounds, states = ctx.saved_tensors
        c, n, blocks, groups, decay, fast, normalization, eps = ctx.meta
        bh, n_pad, feat = q.shape
        dva = v_aug.shape[-1]
        dv, nc = dva - 1, numer.shape[-1]
        d_out = _pad_tokens(d_out, n_pad)
        most = max(g for _, g, _, _ in groups)

        # dL/dS_j is only needed for the current group: a per-block buffer of g+1 chunk-state
        # gradients (not a fresh [BH, L+1, F, Dv+1] tensor, whose first touch alone costs as much
        # as a matmul pass at long N); ``carry`` [BH, F, Dv+1] hands dL/dS at a group's start to
        # the group before it, seeded by the returned state's gradient and ending as dL/dS_0
        carry = d_final.clone()
        dq, dk, d_lam = torch.empty_like(q), torch.empty_like(k), torch.empty_like(lam)
        d_v = q.new_empty(bh, n_pad, dv)  # the ones column of v_aug needs no gradient

        def backward_block(b: int) -> None:
            hb = blocks[b]
            nh = hb.stop - hb.start
            dec_b = decay[hb].view(nh, -1, 1, 1)
            buf = GroupScratch(nh, most, feat, dva, q, backward=True)  # S_{c0 + j} recomputed, dL/dS_{c0 + j}
            for gi, (sl, g, cl, c0) in reversed(list(enumerate(groups))):
                dng = normalize_backward(numer[hb, sl].view(nh * g, cl, nc), d_out[hb, sl].reshape(nh * g, cl, dv), normalization, eps)
                group_backward(
                    q[hb, sl].reshape(nh * g, cl, feat), k[hb, sl].reshape(nh * g, cl, feat), v_aug[hb, sl].reshape(nh * g, cl, dva),
                    lam[hb, sl].reshape(nh * g, cl), m[hb, sl].reshape(nh * g, cl), bounds[hb, c0 : c0 + g + 1],
                    states[hb, gi], dec_b[:, c0 : c0 + g], _all_fast(fast, hb, c0, g), dng, carry[hb], buf,
                    dq[hb, sl].view(nh * g, cl, feat), dk[hb, sl].view(nh * g, cl, feat), d_v[hb, sl].view(nh * g, cl, dv),
                    d_lam[hb, sl].view(nh * g, cl),
                )  # fmt: skip

        for_each_head(backward_block, len(blocks), q.device)
        d_s0 = carry if ctx.needs_input_grad[4] else None
        if n != n_pad:
            dq, dk, d_lam, d_v = (t[:, :n].contiguous() for t in (dq, dk, d_lam, d_v))
        # m0 (the carried log_max) is part of the detached stabiliser: no gradient, like m
        return dq, dk, d_lam, d_v, d_s0, None, None, None, None, None


def unpack_result(
    out: torch.Tensor, final: torch.Tensor, log_max: torch.Tensor, batch: int, heads: int, offset: int
) -> tuple[torch.Tensor, LinearAttentionState]:
    """[BH, N, Dv] output, [BH, F, Dv+1] state with k_sum as its last column and [BH] log_max
    -> (out [B, H, N, Dv], LinearAttentionState)."""
    dv = final.shape[-1] - 1
    final = final.view(batch, heads, final.shape[-2], dv + 1)
    state = LinearAttentionState.from_augmented(final, log_max.view(batch, heads), offset)
    return out.view(batch, heads, -1, dv), state


def chunked_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Chunked causal linear attention (training path): same result as the quadratic form.

    qf, kf [B, H, N, F]; kls [B, H, N] or None (= zeros); v [B, H, N, Dv]; any N >= 1, any
    ``chunk_size`` (a shorter last chunk is handled without padding); ``log_decay`` [H] | None: the
    per-head decay, folded into kls and the state (``decay.folded``).
    Returns (out [B, H, N, Dv] in v.dtype, state in fp32, or fp64 for fp64 inputs).
    Differentiable w.r.t. qf, kf, kls, v, log_decay and the initial state's tensors.
    """
    validate_linear_attention_inputs(
        qf, kf, kls, v, form="chunked", normalization=normalization, chunk_size=chunk_size, initial_state=initial_state,
        eps=eps, log_decay=log_decay,
    )  # fmt: skip
    if log_decay is not None:
        return folded(chunked_linear_attention, qf, kf, kls, v, log_decay, normalization=normalization,
                      chunk_size=chunk_size, initial_state=initial_state, eps=eps)  # fmt: skip
    batch, heads, n, feat = qf.shape
    dv = v.shape[-1]
    with torch.autocast(device_type=qf.device.type, enabled=False):
        q, k, lam, vv, state = fp32_inputs(qf, kf, kls, v, initial_state)
        s0 = state.augmented()  # [B, H, F, Dv+1]
        bh = batch * heads
        out, final, log_max = _ChunkedLinearAttention.apply(
            q.reshape(bh, n, feat).contiguous(),
            k.reshape(bh, n, feat).contiguous(),
            lam.reshape(bh, n).contiguous(),
            vv.reshape(bh, n, dv).contiguous(),
            s0.reshape(bh, feat, dv + 1),
            state.log_max.detach().reshape(bh),  # the stabiliser is a constant for autograd
            chunk_size,
            normalization,
            eps,
            v.dtype,
        )
    return unpack_result(out, final, log_max, batch, heads, state.offset + n)
