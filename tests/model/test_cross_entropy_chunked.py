"""The chunked linear cross-entropy (``train.loss_chunk_tokens``): the projection and the loss a chunk of
tokens at a time equal the whole logits' loss and gradients, and the whole logits never exist."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megaflex.attention.documents import document_positions
from megaflex.model import GPT, IGNORE_INDEX, ModelConfig
from megaflex.model.cross_entropy import chunked_linear_cross_entropy
from megaflex.model.gpt import Documents
from megaflex.model.layers import LocalLayers, pad_vocab_size
from numerics import assert_close, linear_cross_entropy_steps, normwise_scale, training_grad_steps, training_loss_steps

pytestmark = pytest.mark.numerics

VOCAB, HIDDEN, BATCH, SEQ = 301, 32, 2, 13  # 26 tokens: chunks of 7 leave a short last one


class LargestTensor(TorchDispatchMode):
    """The largest tensor (numel) any op returns while active, backward included."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, N, h], output matrix [V padded, h], labels (two ignored) and upstream loss weights."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)
    weight = (0.3 * torch.randn(pad_vocab_size(VOCAB, 1), HIDDEN, generator=g)).to(dtype)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    upstream = torch.rand(BATCH, SEQ, generator=g)
    upstream[0, 4] = upstream[1, 12] = 0.0  # what language_model_loss gives ignored tokens
    return hidden, weight, labels, upstream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 26, 100])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_loss_and_gradients_equal_the_whole_logits(dtype: torch.dtype, chunk: int, label_smoothing: float) -> None:
    hidden, weight, labels, upstream = _inputs(dtype)
    loss_fn = functools.partial(LocalLayers().cross_entropy, vocab_size=VOCAB, label_smoothing=label_smoothing)
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if chunked:
            loss = chunked_linear_cross_entropy(h, w, labels, loss_fn, chunk)
        else:
            loss = loss_fn(F.linear(h, w), labels)
        (loss * upstream).sum().backward()
        assert loss.dtype == torch.float32 and loss.shape == labels.shape
        assert h.grad.dtype == dtype and w.grad.dtype == dtype
        results.append((loss.detach(), h.grad, w.grad))
    (loss, grad_h, grad_w), (want_loss, want_h, want_w) = results[1], results[0]
    max_logit = F.linear(hidden.float(), weight.float()).abs().max().item()
    steps = linear_cross_entropy_steps(HIDDEN, VOCAB, BATCH * SEQ, max_logit, -(-BATCH * SEQ // chunk), dtype)
    # the logits' scale bounds the loss's error (twice theirs); the gradients' own scales theirs
    assert_close(loss, want_loss, steps=steps, dtype=dtype, floor=max_logit, name="loss")
    assert_close(grad_h, want_h, steps=steps, dtype=dtype, name="grad hidden")
    assert_close(grad_w, want_w, steps=steps, dtype=dtype, name="grad weight")
    assert torch.equal(w.grad[VOCAB:], torch.zeros_like(w.grad[VOCAB:]))  # padding rows take no gradient


def _tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**dict(vocab_size=VOCAB, num_layers=2, hidden_size=HIDDEN, num_heads=4, ffn_hidden_size=64,
                              feature_dim=16, chunk_size=8, max_seq_len=64, init_std=0.2), **overrides)


def _lm_batch() -> tuple[torch.Tensor, torch.Tensor, Documents]:
    """Tokens with two documents per row (EOD id 0) and the masks of training: an ignored label per row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    ids[:, 5] = 0
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, 2] = IGNORE_INDEX
    positions = document_positions(ids, 0)
    return ids, labels, Documents(starts=positions == 0, position_ids=positions)


@pytest.mark.parametrize("attention", ["flexformer_n", "softmax"])
def test_gpt_with_the_chunked_loss_trains_as_with_the_whole_logits(attention: str) -> None:
    config = _tiny_config(attention=attention)
    torch.manual_seed(0)
    whole = GPT(config).train()
    chunked = copy.deepcopy(whole)
    chunked.set_loss_chunk_tokens(7)
    ids, labels, documents = _lm_batch()
    outs = {}
    for name, model in (("whole", whole), ("chunked", chunked)):
        out = model(ids, labels, documents=documents)
        out.loss.backward()
        outs[name] = out
    assert outs["chunked"].logits is None and outs["whole"].logits is not None
    tokens = int((labels != IGNORE_INDEX).sum())
    steps = training_loss_steps(config, SEQ, tokens) + HIDDEN
    assert_close(outs["chunked"].loss, outs["whole"].loss.detach(), steps=steps, name="loss")
    assert_close(outs["chunked"].per_token_loss, outs["whole"].per_token_loss.detach(), steps=steps, name="per-token loss")
    assert torch.all(outs["chunked"].per_token_loss[labels == IGNORE_INDEX] == 0)
    grads = dict(whole.named_parameters())
    terms = max(normwise_scale(p.grad) for p in grads.values())  # entries near 0 carry the largest terms' rounding
    for name, p in chunked.named_parameters():
        assert normwise_scale(p.grad) > 0, name
        assert_close(p.grad, grads[name].grad, steps=training_grad_steps(config, SEQ, BATCH * SEQ) + HIDDEN,
                     floor=terms, name=name)
    with torch.no_grad():  # evaluation: the same loss, and still no logits
        evaluated = chunked.eval()(ids, labels, documents=documents)
    assert evaluated.logits is None
    assert_close(evaluated.loss, outs["whole"].loss.detach(), steps=steps, name="eval loss")


def test_the_whole_logits_never_exist_with_the_chunked_loss() -> None:
    """Forward and backward of a step: no op returns a tensor as large as the [tokens, vocab] logits
    (the check sees them without chunking)."""
    torch.manual_seed(0)
    model = GPT(_tiny_config()).train()
    ids = torch.randint(0, VOCAB, (BATCH, 64), generator=torch.Generator().manual_seed(1))
    logits_numel = ids.numel() * VOCAB  # 3x the output matrix's
    largest = {}
    for chunk in (0, 7):
        model.set_loss_chunk_tokens(chunk)
        with LargestTensor() as seen:
            model(ids, ids).loss.backward()
        largest[chunk] = seen.numel
    assert largest[0] >= logits_numel
    assert largest[7] <= model.output_weight.numel()  # the largest: the output matrix's gradient


def test_a_micro_batch_of_one_chunk_or_less_keeps_the_whole_logits() -> None:
    """No chunk to save memory on: the whole path, no recompute (and the logits are returned)."""
    torch.manual_seed(0)
    model = GPT(_tiny_config())
    ids, labels, _ = _lm_batch()
    for chunk, chunked in ((BATCH * SEQ - 1, True), (BATCH * SEQ, False), (10**6, False)):
        model.set_loss_chunk_tokens(chunk)
        assert (model(ids, labels).logits is None) == chunked, chunk


def test_bad_chunk_sizes_are_refused() -> None:
    hidden, weight, labels, _ = _inputs(torch.float32)
    loss_fn = functools.partial(LocalLayers().cross_entropy, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="chunk_tokens: expected a positive integer, got 0"):
        chunked_linear_cross_entropy(hidden, weight, labels, loss_fn, 0)
    with pytest.raises(ValueError, match=r"labels: expected shape \(2, 13\)"):
        chunked_linear_cross_entropy(hidden, weight, labels[:, :5], loss_fn, 4)
    model = GPT(_tiny_config())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens: expected an int >= 0"):
            model.set_loss_chunk_tokens(bad)
