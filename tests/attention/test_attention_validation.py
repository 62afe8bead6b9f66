"""Bad input raises ValueError naming the argument, with expected vs got."""

from __future__ import annotations

import re

import pytest
import torch

from attention_helpers import make_map
from megaflex.attention import (
    ATTENTION_KINDS,
    FEATURE_MAP_KINDS,
    AttentionCore,
    KVCache,
    LinearAttentionState,
    build_feature_map,
    causal_linear_attention,
)

B, H, N, F, DV = 2, 3, 5, 4, 6


def _inputs():
    return torch.randn(B, H, N, F), torch.randn(B, H, N, F), torch.randn(B, H, N), torch.randn(B, H, N, DV)


def _expect(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


@pytest.mark.parametrize(
    "which, bad, message",
    [
        ("qf", torch.randn(B, H, F), "qf: expected a rank-4 tensor, got shape (2, 3, 4) (rank 3)"),
        ("qf", torch.ones(B, H, N, F, dtype=torch.long), "qf: expected a floating-point tensor, got dtype torch.int64"),
        ("kf", torch.randn(B, H, N, F + 1), "kf: expected shape (2, 3, 5, 4) (same as qf [B, H, N, F]), got (2, 3, 5, 5)"),
        ("kf", torch.randn(B, H, N + 1, F), "kf: expected shape (2, 3, 5, 4)"),
        ("v", torch.randn(B, H + 1, N, DV), "v: expected shape [2, 3, 5, Dv] (B, H, N of qf), got (2, 4, 5, 6)"),
        ("v", torch.ones(B, H, N, DV, dtype=torch.int32), "v: expected a floating-point tensor, got dtype torch.int32"),
        ("kls", torch.randn(B, H, N, 1), "kls: expected a rank-3 tensor, got shape (2, 3, 5, 1) (rank 4)"),
        ("kls", torch.randn(B, H, N - 1), "kls: expected shape [2, 3, 5] (B, H, N of qf) or None, got (2, 3, 4)"),
    ],
)
def test_bad_tensors(which, bad, message):
    args = dict(zip(("qf", "kf", "kls", "v"), _inputs()))
    args[which] = bad
    with _expect(message):
        causal_linear_attention(args["qf"], args["kf"], args["kls"], args["v"], form="quadratic")


def test_empty_sequence():
    with _expect("qf: expected at least one token (N >= 1), got shape (2, 3, 0, 4)"):
        causal_linear_attention(torch.randn(B, H, 0, F), torch.randn(B, H, 0, F), None, torch.randn(B, H, 0, DV))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"form": "fast"}, "form: expected one of ('chunked', 'recurrent', 'quadratic'), got 'fast'"),
        ({"normalization": "l2"}, "normalization: expected one of ('rms', 'denominator', 'capped_denominator'), got 'l2'"),
        ({"chunk_size": 0}, "chunk_size: expected a positive int, got 0"),
        ({"eps": 0.0}, "eps: expected a positive float, got 0.0"),
    ],
)
def test_bad_options(kwargs, message):
    with _expect(message):
        causal_linear_attention(*_inputs(), **kwargs)


def _state(**overrides):
    fields = dict(kv=torch.zeros(B, H, F, DV), k_sum=torch.zeros(B, H, F), log_max=torch.zeros(B, H), offset=3)
    fields.update(overrides)
    return LinearAttentionState(**fields)


@pytest.mark.parametrize(
    "state, message",
    [
        (_state(kv=torch.zeros(B, H, DV, F)), "initial_state.kv: expected a floating tensor of shape (2, 3, 4, 6), got (2, 3, 6, 4) torch.float32"),
        (_state(k_sum=torch.zeros(B, H, F + 1)), "initial_state.k_sum: expected a floating tensor of shape (2, 3, 4), got (2, 3, 5)"),
        (_state(log_max=torch.zeros(B)), "initial_state.log_max: expected a floating tensor of shape (2, 3), got (2,)"),
        (_state(log_max=torch.zeros(B, H, dtype=torch.long)), "initial_state.log_max: expected a floating tensor of shape (2, 3), got (2, 3) torch.int64"),
        (_state(offset=-1), "initial_state.offset: expected >= 0, got -1"),
        ((torch.zeros(1),), "initial_state: expected a LinearAttentionState or None, got tuple"),
    ],
)
@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
def test_bad_initial_state(state, message, form):
    with _expect(message):
        causal_linear_attention(*_inputs(), form=form, initial_state=state)


# ----------------------------------------------------------------------------- feature maps


def test_unknown_kind_lists_the_kinds():
    with _expect(f"kind: expected one of {FEATURE_MAP_KINDS}, got 'favor'"):
        build_feature_map("favor", 2, 8, 16)
    with _expect(f"kind: expected one of {ATTENTION_KINDS}, got 'favor'"):
        AttentionCore("favor", 2, 8)


@pytest.mark.parametrize(
    "kind, args, kwargs, message",
    [
        ("flexformer_n", (2, 8, 15), {}, "feature_dim: expected a positive even number for 'flexformer_n' (F = 2 * frequencies), got 15"),
        ("flexformer_s", (2, 8, 0), {}, "feature_dim: expected a positive even number for 'flexformer_s'"),
        ("hedgehog", (2, 8, 7), {}, "feature_dim: expected a positive even number for 'hedgehog'"),
        ("performer", (2, 8, 16), {"variant": "relu"}, "variant: expected one of ('positive', 'trig'), got 'relu'"),
        ("performer", (2, 8, 16), {"redraw_interval": 0}, "redraw_interval: expected a positive number of steps or None, got 0"),
        ("flexformer_s", (0, 8, 16), {}, "num_heads: expected a positive int, got 0"),
        ("elu", (2, 8, 16), {"max_seq_len": 4}, "kwargs: 'elu' accepts [], got unknown ['max_seq_len']"),
        ("cosformer", (2, 8, 16), {"max_seq_len": 0}, "max_seq_len: expected a positive length, got 0"),
    ],
)
def test_bad_feature_map_arguments(kind, args, kwargs, message):
    with _expect(message):
        build_feature_map(kind, *args, **kwargs)


@pytest.mark.parametrize("kind", FEATURE_MAP_KINDS)
def test_feature_map_rejects_wrong_head_dim_heads_rank_and_dtype(kind):
    fmap = make_map(kind, 2, 8, 16)
    name = type(fmap).__name__
    with _expect(f"x: expected shape [B, 2, N, 8] (heads=2, head_dim=8 of the {name}), got (1, 2, 5, 4)"):
        fmap(torch.randn(1, 2, 5, 4))
    with _expect("x: expected shape [B, 2, N, 8]"):
        fmap(torch.randn(1, 3, 5, 8))
    with _expect("got (2, 5, 8)"):
        fmap(torch.randn(2, 5, 8))
    with _expect("x: expected a floating-point tensor, got dtype torch.int64"):
        fmap(torch.ones(1, 2, 5, 8, dtype=torch.long))


# ----------------------------------------------------------------------------- AttentionCore


@pytest.mark.parametrize("kind", ["flexformer_n", "softmax"])
def test_attention_core_input_validation(kind):
    core = AttentionCore(kind, 2, 8, feature_dim=16)
    q = torch.randn(1, 2, 5, 8)
    with _expect("k: expected shape [B, 2, N, 8] = (1, 2, 5, 8) (num_heads=2, head_dim=8), got (1, 2, 5, 4)"):
        core(q, torch.randn(1, 2, 5, 4), q)
    with _expect("q: expected shape [B, 2, N, 8] = (1, 2, 5, 8) (num_heads=2, head_dim=8), got (1, 2, 5, 16)"):
        core(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    with _expect("v: expected shape [1, 2, 5, Dv], got (1, 2, 4, 8)"):
        core(q, q, torch.randn(1, 2, 4, 8))
    with _expect("q: expected a floating-point tensor, got dtype torch.int64"):
        core(q.long(), q, q)
    with _expect("q: expected a rank-4 tensor, got shape (2, 5, 8) (rank 3)"):
        core(q[0], q, q)


def test_attention_core_state_type_and_options():
    with _expect("state: expected a LinearAttentionState for kind 'flexformer_s', got KVCache"):
        q = torch.randn(1, 2, 3, 8)
        AttentionCore("flexformer_s", 2, 8, feature_dim=16)(q, q, q, state=KVCache(q, q))
    with _expect("state: expected a KVCache for kind 'softmax', got LinearAttentionState"):
        AttentionCore("softmax", 2, 8)(q, q, q, state=LinearAttentionState.empty(1, 2, 16, 8))
    with _expect("normalization: expected one of ('rms', 'denominator', 'capped_denominator'), got 'none'"):
        AttentionCore("elu", 2, 8, normalization="none")
    with _expect("form: expected one of ('chunked', 'recurrent', 'quadratic'), got 'scan'"):
        AttentionCore("elu", 2, 8, form="scan")
    with _expect("feature_kwargs: 'softmax' takes none, got ['variant']"):
        AttentionCore("softmax", 2, 8, variant="trig")
