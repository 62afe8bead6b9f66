"""The chunked loss (``train.loss_chunk_tokens``) under tensor parallelism: the chunks wrap each rank's
vocab-parallel logits (and, with sequence parallelism, the gathered sequence) and give the loss and
gradients of the whole vocab-parallel logits."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from megaflex.model import GPT, IGNORE_INDEX, ModelConfig
from megaflex.parallel import ParallelState, parallelize_gpt
from numerics import assert_close, normwise_scale, training_grad_steps, training_loss_steps

VOCAB, SEQ = 301, 14  # the vocabulary splits unevenly (the last shard holds padding); SEQ splits over 2 ranks
CONFIG = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, feature_dim=16,
              chunk_size=8, max_seq_len=64, init_std=0.2)


def _worker(rank: int, world: int) -> dict:
    state = ParallelState.create(tensor_parallel_size=world)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels[0, 3] = labels[1, -1] = IGNORE_INDEX
    results = {}
    for sp in (False, True):
        for chunk in (0, 5):
            torch.manual_seed(0)
            model = parallelize_gpt(GPT(ModelConfig(**CONFIG)), state, seed=3, sequence_parallel=sp)
            model.set_loss_chunk_tokens(chunk)
            out = model(ids, labels=labels)
            out.loss.backward()
            assert (out.logits is None) == bool(chunk)
            results[sp, chunk] = {"loss": out.loss.detach(), "per_token": out.per_token_loss.detach(),
                                  "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    return results


@pytest.mark.slow
@pytest.mark.numerics
def test_chunked_loss_equals_the_vocab_parallel_loss_under_tp_and_sp() -> None:
    config = ModelConfig(**CONFIG)
    tokens = 2 * SEQ
    loss_steps = training_loss_steps(config, SEQ, tokens, ranks=2) + config.hidden_size
    grad_steps = training_grad_steps(config, SEQ, tokens, ranks=2) + config.hidden_size
    for per_rank in run_distributed(_worker, 2):
        for sp in (False, True):
            whole, chunked = per_rank[sp, 0], per_rank[sp, 5]
            assert_close(chunked["loss"], whole["loss"], steps=loss_steps, name=f"loss sp={sp}")
            assert_close(chunked["per_token"], whole["per_token"], steps=loss_steps, name=f"per-token loss sp={sp}")
            terms = max(normwise_scale(g) for g in whole["grads"].values())
            for name, grad in whole["grads"].items():
                assert normwise_scale(chunked["grads"][name]) > 0, name
                assert_close(chunked["grads"][name], grad, steps=grad_steps, floor=terms, name=f"{name} sp={sp}")
