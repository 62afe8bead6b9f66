"""Exact token accounting of megaflex.eval.scoring with tiny GPTs built here (no checkpoint)."""

from __future__ import annotations

import math

import pytest
import torch

from megaflex.eval.scoring import EvalResult, evaluate, evaluate_stateful, evaluate_windows, plan_windows, shard
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT

VOCAB = 97


def tiny_gpt(attention: str = "flexformer_n", seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    config = ModelConfig(**{
        "vocab_size": VOCAB, "num_layers": 2, "hidden_size": 32, "num_heads": 2, "attention": attention,
        "feature_dim": 16, "chunk_size": 8, "max_seq_len": 1024, **overrides,
    })
    return GPT(config).eval()


def random_docs(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


DOC_LENGTHS = [1, 2, 5, 37, 64, 100, 129]


def full_forward_nll(model: GPT, docs: list[torch.Tensor]) -> tuple[float, int]:
    """Reference: one whole-document forward per document, NLL of every target summed in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            if len(d) < 2:
                continue
            out = model(d[None, :-1], labels=d[None, 1:])
            total += out.per_token_loss.double().sum().item()
            count += len(d) - 1
    return total, count


# --- planning --------------------------------------------------------------------------------


@pytest.mark.parametrize("context,stride", [(1, None), (4, None), (16, None), (16, 16), (16, 5), (16, 1), (7, 3)])
def test_plan_scores_every_target_exactly_once(context: int, stride: int | None) -> None:
    lengths = [0, 1, 2, 3, 16, 17, 33, 100]
    windows = plan_windows(lengths, context, stride)
    seen: dict[int, list[int]] = {d: [] for d in range(len(lengths))}
    for w in windows:
        assert w.end - w.begin <= context
        assert w.begin <= w.score_from < w.end
        seen[w.doc].extend(range(w.score_from, w.end))
    for d, n in enumerate(lengths):
        assert seen[d] == list(range(max(n - 1, 0))), f"doc {d} of length {n}"


def test_plan_sliding_sees_full_context_after_the_first_window() -> None:
    windows = plan_windows([200], context=32, stride=8)
    assert windows[0].score_from == 0
    for w in windows[1:]:
        # every scored target except in the first window sees at least context - stride tokens
        assert w.score_from - w.begin + 1 >= 32 - 8 + 1


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="stride"):
        plan_windows([10], context=4, stride=5)
    with pytest.raises(ValueError, match="context"):
        plan_windows([10], context=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_partitions_items(world_size: int) -> None:
    weights = [5, 1, 9, 9, 2, 7, 3]
    parts = [shard(len(weights), weights, r, world_size) for r in range(world_size)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(weights)))


# --- the modes agree with a full forward -------------------------------------------------------


@pytest.mark.parametrize("attention", ["flexformer_n", "softmax"])
@pytest.mark.parametrize("context,batch_size", [(1, 3), (7, 2), (1000, 4)])
def test_stateful_equals_one_full_length_forward(attention: str, context: int, batch_size: int) -> None:
    """Chunks of 1 (the recurrent decode path), 7 (chunked + carried state) and one chunk;
    batches mix document lengths (right padding must not change any score)."""
    model = tiny_gpt(attention)
    lengths = [1, 2, 5, 23, 40, 9]
    docs = random_docs(lengths)
    ref_nll, ref_count = full_forward_nll(model, docs)
    result = evaluate(model, docs, "stateful", context, batch_size=batch_size)
    assert result.tokens == ref_count == sum(n - 1 for n in lengths if n > 1)
    assert result.nll_sum == pytest.approx(ref_nll, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(ref_nll / ref_count), rel=1e-5)


def test_sliding_with_stride_equal_to_context_is_windows() -> None:
    model = tiny_gpt()
    docs = random_docs(DOC_LENGTHS)
    windows = evaluate(model, docs, "windows", 16)
    sliding = evaluate(model, docs, "sliding", 16, stride=16)
    assert windows.tokens == sliding.tokens == sum(n - 1 for n in DOC_LENGTHS if n > 1)
    assert windows.nll_sum == pytest.approx(sliding.nll_sum, rel=1e-12)


def test_windows_longer_than_documents_equal_full_forward() -> None:
    model = tiny_gpt()
    docs = random_docs(DOC_LENGTHS)
    ref_nll, ref_count = full_forward_nll(model, docs)
    result = evaluate(model, docs, "windows", 256)
    assert result.tokens == ref_count
    assert result.nll_sum == pytest.approx(ref_nll, rel=1e-5)


@pytest.mark.parametrize("context,stride", [(8, 3), (8, 8), (5, 2)])
def test_sliding_scores_each_target_with_its_own_window(context: int, stride: int) -> None:
    """Target t is scored by the first window reaching it, which starts at k * stride with
    k = max(0, floor((t - context) / stride) + 1); check against one forward per target."""
    model = tiny_gpt("softmax")
    (doc,) = random_docs([30])
    expected = 0.0
    with torch.no_grad():
        for t in range(len(doc) - 1):
            begin = max(0, (t - context) // stride + 1) * stride
            out = model(doc[None, begin : t + 1], labels=doc[None, begin + 1 : t + 2])
            expected += out.per_token_loss[0, -1].double().item()
    result = evaluate(model, [doc], "sliding", context, stride=stride)
    assert result.tokens == len(doc) - 1
    assert result.nll_sum == pytest.approx(expected, rel=1e-5)


# --- accounting details ----------------------------------------------------------------------


def test_bytes_and_context_buckets_are_counted_per_target() -> None:
    model = tiny_gpt()
    docs = random_docs(DOC_LENGTHS)
    token_bytes = torch.arange(VOCAB) % 4  # some tokens count 0 bytes, like control tokens
    expected_bytes = sum(int(token_bytes[d[1:]].sum()) for d in docs)
    for mode, context in [("stateful", 16), ("windows", 16), ("sliding", 16)]:
        result = evaluate(model, docs, mode, context, token_bytes=token_bytes)
        assert result.bytes == expected_bytes, mode
        assert result.bits_per_byte == pytest.approx(result.nll_sum / (math.log(2) * expected_bytes))
        rows = result.by_context()
        assert sum(r["tokens"] for r in rows) == result.tokens
        # buckets (2^(b-1), 2^b]: windows of 16 never give a target more than 16 tokens of context
        max_ctx = max(r["context_max"] for r in rows)
        assert max_ctx == (128 if mode == "stateful" else 16), mode


def test_stateful_buckets_count_targets_by_document_position() -> None:
    model = tiny_gpt()
    docs = random_docs([10, 40])
    rows = {r["context_max"]: r["tokens"] for r in evaluate(model, docs, "stateful", 8).by_context()}
    # target t (0-based) sees t + 1 tokens; doc of 10 has contexts 1..9, doc of 40 has 1..39
    def count(lo: int, hi: int) -> int:
        return sum(1 for n in (10, 40) for c in range(1, n) if lo < c <= hi)
    assert rows == {2**b: count(2 ** (b - 1) if b else 0, 2**b) for b in range(7) if count(2 ** (b - 1) if b else 0, 2**b)}


@pytest.mark.parametrize("mode", ["windows", "sliding", "stateful"])
def test_rank_shares_add_up_to_the_single_rank_result(mode: str) -> None:
    model = tiny_gpt()
    docs = random_docs([1, 2, 5, 37, 64, 20])
    single = evaluate(model, docs, mode, 16)
    for world_size in (2, 4):
        parts = []
        for rank in range(world_size):
            if mode == "stateful":
                parts.append(evaluate_stateful(model, docs, 16, rank=rank, world_size=world_size))
            else:
                stride = None if mode == "windows" else 8
                parts.append(evaluate_windows(model, docs, 16, stride, rank=rank, world_size=world_size))
        total = sum(parts, EvalResult())
        assert total.tokens == single.tokens
        assert total.nll_sum == pytest.approx(single.nll_sum, rel=1e-6)
        assert total.bucket_tokens == single.bucket_tokens
        assert any(p.tokens < single.tokens for p in parts)  # the work really was split


def test_evaluate_restores_training_mode_and_rejects_bad_mode() -> None:
    model = tiny_gpt().train()
    docs = random_docs([20])
    evaluate(model, docs, "windows", 8)
    assert model.training
    with pytest.raises(ValueError, match="mode"):
        evaluate(model, docs, "chunked", 8)
    with pytest.raises(ValueError, match="stride"):
        evaluate(model, docs, "windows", 8, stride=4)
