"""``megaflex.model.compile``: blocks compiled one by one train as the eager model, keep its parameter
names, share one compiled graph and leave the attention core eager."""

from __future__ import annotations

import copy

import pytest
import torch

from megaflex.model import GPT, ModelConfig
from megaflex.model.compile import compile_blocks, compiled_blocks
from megaflex.model.gpt import call_attention_core
from numerics import assert_close, gpt_steps, normwise_scale

SEQ = 32
LAYERS = 4


@pytest.mark.slow  # the first compile takes minutes on a loaded 2-core CPU (inductor's C++ backend)
@pytest.mark.numerics
def test_compiled_blocks_train_as_eager_with_activation_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # tests/conftest.py switches it off for the suite

    config = ModelConfig(vocab_size=301, num_layers=LAYERS, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                         feature_dim=16, chunk_size=8, max_seq_len=64, activation_checkpointing=True)
    torch.manual_seed(0)
    eager = GPT(config).train()
    compiled = compile_blocks(copy.deepcopy(eager))
    assert compiled_blocks(compiled) == LAYERS and compiled_blocks(eager) == 0
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefixes
    assert all(b.attn.run_attention is not call_attention_core for b in compiled.blocks)  # the graph break

    ids = torch.randint(0, 301, (2, SEQ), generator=torch.Generator().manual_seed(1))
    counters.clear()
    outs = [model(ids, ids) for model in (eager, compiled)]
    for out in outs:
        out.loss.backward()
    # one graph serves every block: per-block graphs would be at least two per block (around the break)
    assert 0 < counters["stats"]["unique_graphs"] < 2 * LAYERS
    assert_close(outs[1].loss, outs[0].loss.detach(), steps=gpt_steps(config, SEQ) + 301, name="loss")
    terms = max(normwise_scale(p.grad) for p in eager.parameters())
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, steps=gpt_steps(config, SEQ, backward=True) + 2 * (ids.numel() + 301),
                     floor=terms, name=name)


def test_compile_blocks_refuses_when_torch_compile_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile then hands the function back unchanged: no silently eager "compiled" model."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model = GPT(ModelConfig(vocab_size=301, num_layers=1, hidden_size=32, num_heads=4, feature_dim=16, max_seq_len=64))
    with pytest.raises(RuntimeError, match="torch.compile is disabled in this process"):
        compile_blocks(model)
