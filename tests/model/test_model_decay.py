"""``model.kernel_decay: learned`` in the GPT: a per-head decay logit in every layer (the hybrid's far field
too), trained on the temperature LR group without weight decay, sharded over TP ranks with its heads."""

from __future__ import annotations

import copy

import pytest
import torch

from megaflex.attention import named_kernel_parameters
from megaflex.model import GPT, ModelConfig
from megaflex.parallel import ParallelDims, ParallelState, parallelize_gpt
from megaflex.training.optim import param_groups

BASE = dict(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, feature_dim=16, chunk_size=8, max_seq_len=64)


@pytest.mark.parametrize("window", [0, 6])
def test_every_layer_learns_its_decay(window: int) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**BASE, softmax_window=window, kernel_decay="learned"))
    decays = {name: kp for name, kp in named_kernel_parameters(model) if name.endswith("decay_logit")}
    assert len(decays) == 2 and all(kp.role == "temperature" and kp.param.shape == (4,) for kp in decays.values())
    ids = torch.randint(0, 64, (2, 40))
    model(ids, labels=ids).loss.backward()
    assert all(torch.isfinite(kp.param.grad).all() and kp.param.grad.abs().sum() > 0 for kp in decays.values())
    groups = {g["name"]: g for g in param_groups(model, 0.1, lr_multipliers={"temperature": 10.0})}
    temperature = {id(p) for p in groups["kernel_temperature"]["params"]}
    assert groups["kernel_temperature"]["weight_decay"] == 0.0
    assert all(id(kp.param) in temperature for kp in decays.values())
    plain = GPT(ModelConfig(**BASE, softmax_window=window, kernel_decay="none"))
    assert not any("decay_logit" in name for name, _ in plain.named_parameters())


def test_tensor_parallel_ranks_keep_their_heads_decays() -> None:
    torch.manual_seed(0)
    full = GPT(ModelConfig(**BASE, kernel_decay="learned"))
    with torch.no_grad():
        full.blocks[0].attn.core.decay_logit.copy_(torch.arange(4.0))
    for rank in range(2):
        model = parallelize_gpt(copy.deepcopy(full), ParallelState(ParallelDims(2, tp_size=2), rank), seed=0)
        assert torch.equal(model.blocks[0].attn.core.decay_logit.detach(), torch.arange(2.0 * rank, 2.0 * rank + 2))
