"""An encoder classifier built from the GPT's own blocks (Long Range Arena tasks).

    ids [B, N] (+ mask) -> GPT.encode (bidirectional attention: ``model.causal: false``)
        -> pooling (the first real token, "cls"; or the mean over real tokens, "mean"; zeros for a row
           without any) -> MLP -> logits
    two towers (LRA Retrieval): one shared encoder over both documents, then LRA's dual-encoder
    features [u, v, u * v, u - v] -> MLP -> logits

The blocks, norms, embeddings and attention kinds are exactly the GPT's: only ``causal`` differs,
so every attention kind (and the hybrid) is available to the encoder, and the speed and memory
measured here are the language model's. The tied embedding's output projection is not used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.model.layers import linear, normal_init

POOLINGS = ("cls", "mean")


class ClassifierOutput(NamedTuple):
    logits: torch.Tensor  # [B, num_classes] fp32
    loss: torch.Tensor | None = None  # mean cross-entropy over the batch


class EncoderClassifier(nn.Module):
    """``num_classes``-way classifier over one sequence (``towers=1``) or a pair (``towers=2``)."""

    def __init__(self, config: ModelConfig, num_classes: int, pooling: str = "mean", towers: int = 1) -> None:
        super().__init__()
        if config.causal:
            raise ValueError("EncoderClassifier: model.causal must be false (a bidirectional encoder), got true")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {POOLINGS}, got {pooling!r}")
        if towers not in (1, 2):
            raise ValueError(f"towers: expected 1 (one sequence) or 2 (a pair of documents), got {towers}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes: expected an int >= 2, got {num_classes!r}")
        self.config, self.pooling, self.towers, self.num_classes = config, pooling, towers, num_classes
        self.backbone = GPT(config)
        h, init = config.hidden_size, normal_init(config.init_std)
        self.head = nn.Sequential(
            linear(h * (4 if towers == 2 else 1), h, bias=True, init_method=init), nn.GELU(),
            linear(h, num_classes, bias=True, init_method=init),
        )  # fmt: skip

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, N] ids (+ [B, N] mask, 1 = real) -> [B, h]: the first real token's state ("cls") or the
        mean over real tokens ("mean"). A row without real tokens (all padding, or N = 0: an empty
        document) pools to zeros, so the head sees its bias, never a division by zero."""
        batch, n = input_ids.shape
        if n == 0:  # nothing to encode (the blocks' chunking would divide by the length)
            return torch.zeros(batch, self.config.hidden_size, device=input_ids.device, dtype=self.head[0].weight.dtype)
        hidden = self.backbone.encode(input_ids, attention_mask)
        if attention_mask is None:
            return hidden[:, 0] if self.pooling == "cls" else hidden.mean(dim=1)
        real = attention_mask.bool()
        if self.pooling == "cls":
            pooled = hidden[torch.arange(batch, device=hidden.device), real.long().argmax(dim=1)]
        else:  # masked_fill, not a product: a padded position's state never reaches the sum
            pooled = hidden.masked_fill(~real.unsqueeze(-1), 0.0).sum(dim=1) / real.sum(dim=1, keepdim=True).clamp(min=1)
        return pooled.masked_fill(~real.any(dim=1, keepdim=True), 0.0)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
        pair_ids: torch.Tensor | None = None, pair_mask: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        """Logits (and the loss with ``labels`` [B]); ``pair_ids``/``pair_mask``: the second
        document of each pair (``towers=2`` only)."""
        if (pair_ids is not None) != (self.towers == 2):
            raise ValueError(f"pair_ids: expected {'a second document' if self.towers == 2 else 'none'} for "
                             f"towers={self.towers}")  # fmt: skip
        u = self.pooled(input_ids, attention_mask)
        if self.towers == 2:
            v = self.pooled(pair_ids, pair_mask)
            u = torch.cat([u, v, u * v, u - v], dim=-1)
        logits = self.head(u).float()
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return ClassifierOutput(logits, loss)
