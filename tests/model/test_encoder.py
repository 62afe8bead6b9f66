"""The encoder classifier (``megaflex.model.encoder``): bidirectional GPT blocks, pooling that
ignores padding, the two-tower head, and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaflex.model import ModelConfig
from megaflex.model.encoder import EncoderClassifier
from numerics import assert_close, gpt_steps

KINDS = ("softmax", "flexformer_n", "performer", "cosformer")


def _config(kind: str, **changes) -> ModelConfig:
    config = ModelConfig(vocab_size=40, num_layers=2, hidden_size=16, num_heads=2, attention=kind, feature_dim=8,
                         max_seq_len=32, position="learned", causal=False)  # fmt: skip
    return dataclasses.replace(config, **changes)


def _model(kind: str, pooling: str = "mean", towers: int = 1, **changes) -> EncoderClassifier:
    torch.manual_seed(0)
    return EncoderClassifier(_config(kind, **changes), 3, pooling, towers).eval()


def _batch(lengths: list[int], n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, n] (pads: id 0) and their mask."""
    ids = torch.randint(3, 40, (len(lengths), n), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("kind", KINDS)
def test_padding_changes_no_logit(kind, pooling):
    """Each row of a right-padded batch gives the logits it gives alone; pad ids do not matter."""
    model = _model(kind, pooling)
    ids, mask = _batch([9, 5], 12)
    with torch.no_grad():
        batched = model(ids, mask).logits
        repadded = model(ids.masked_fill(~mask, 7), mask).logits
        alone = torch.cat([model(ids[i : i + 1, :n]).logits for i, n in enumerate([9, 5])])
    assert torch.equal(batched, repadded)
    # the head adds two more sums of the hidden size; mean pooling sums over the tokens
    assert_close(batched, alone, steps=gpt_steps(model.config, 12) + 2 * model.config.hidden_size + 12, name="logits")


@pytest.mark.parametrize("kind", KINDS)
def test_every_token_reaches_the_pooled_state(kind):
    """Bidirectional: the first token's state (cls pooling) depends on the last token."""
    model = _model(kind, "cls")
    ids, _ = _batch([10], 10)
    changed = ids.clone()
    changed[0, -1] = 3 if ids[0, -1] != 3 else 4
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(changed).logits)


def test_two_towers_read_both_documents_and_train():
    model = _model("flexformer_n", towers=2).train()
    a, mask_a = _batch([8, 6], 8, seed=1)
    b, mask_b = _batch([5, 8], 8, seed=2)
    labels = torch.tensor([0, 2])
    out = model(a, mask_a, labels, pair_ids=b, pair_mask=mask_b)
    assert out.logits.shape == (2, 3)
    assert torch.equal(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    out.loss.backward()
    assert all(p.grad is not None for p in model.head.parameters())
    with torch.no_grad():
        swapped = model(b, mask_b, pair_ids=a, pair_mask=mask_a).logits
    assert not torch.equal(swapped, out.logits.detach())  # [u, v, u*v, u-v] is ordered


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="model.causal must be false"):
        EncoderClassifier(_config("softmax", causal=True), 3)
    with pytest.raises(ValueError, match="pooling"):
        EncoderClassifier(_config("softmax"), 3, pooling="max")
    with pytest.raises(ValueError, match="towers"):
        EncoderClassifier(_config("softmax"), 3, towers=3)
    with pytest.raises(ValueError, match="num_classes"):
        EncoderClassifier(_config("softmax"), 1)
    ids, mask = _batch([4], 4)
    with pytest.raises(ValueError, match="pair_ids"):
        _model("softmax", towers=2)(ids, mask)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("kind,window", [("softmax", 0), ("flexformer_n", 0), ("performer", 0), ("flexformer_n", 3),
                                         ("softmax", 3)])  # fmt: skip
def test_padding_between_real_tokens_changes_no_logit(kind, window, pooling):
    """Pads before, between and after real tokens: each row gives the logits of its real tokens alone
    (positions count real tokens, the window too; cls reads the first real token)."""
    model = _model(kind, pooling, softmax_window=window)
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[i not in (0, 3, 4, 9) for i in range(12)], [i not in (2, 6, 10, 11) for i in range(12)]])
    with torch.no_grad():
        batched = model(ids.masked_fill(~mask, 0), mask).logits
        alone = torch.cat([model(ids[b : b + 1, mask[b]]).logits for b in range(2)])
    assert_close(batched, alone, steps=gpt_steps(model.config, 12) + 2 * model.config.hidden_size + 12, name="logits")


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("kind", ["softmax", "flexformer_n"])
def test_a_row_without_real_tokens_pools_to_zeros(kind, pooling):
    """All padding, or no token at all (an empty document): zeros into the head, finite loss and gradients."""
    model = _model(kind, pooling).train()
    ids, mask = _batch([5, 0], 5)
    for inputs, masks in (((ids, mask)), (ids[:, :0], mask[:, :0])):
        out = model(inputs, masks, labels=torch.tensor([0, 1]))
        bias = model.head(torch.zeros(1, model.config.hidden_size)).float()
        assert torch.equal(out.logits[1:], bias) and torch.isfinite(out.loss)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()
    assert torch.equal(model.pooled(ids[:, :0]), torch.zeros(2, model.config.hidden_size))
