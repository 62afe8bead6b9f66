"""Megatron-style sequence parallelism (``parallel.sequence_parallel``): the GPT under TP=2 with the
residual stream split along the sequence equals the same TP=2 model without it, in forward outputs,
loss and every parameter gradient (norm weights and biases, row-parallel biases and learned positions
included, whose gradients are summed over the sequence shards); alone and with context parallelism.
Dropout on the sequence shards draws different masks on the two TP ranks, and activation checkpointing
replays them. Config validation; distillation refuses it. The training run under the deepspeed launcher is in
``test_training_sequence_parallel.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from distributed import run_distributed
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT, Documents
from megaflex.model.layers import LocalLayers
from megaflex.parallel import ParallelState, parallelize_gpt
from megaflex.parallel.context_parallel import sequence_slice
from megaflex.training.config import ConfigError, load_config
from megaflex.training.distill.objectives import AttentionTransfer, Finetune
from numerics import assert_close, gpt_steps, normwise_scale
from training_harness import TINY

VOCAB = 301  # not divisible by 2
SEQ = 16
CONFIGS = {
    # Flexformer-N, RMSNorm, RoPE, tied embeddings, GELU, no bias
    "flex_rms_rope": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                          feature_dim=16, chunk_size=8, max_seq_len=64),
    # LayerNorm (weight and bias), learned positions, untied head, SwiGLU, biases everywhere
    "hedgehog_ln_learned": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="hedgehog",
                                feature_dim=16, chunk_size=8, max_seq_len=64, tie_embeddings=False, mlp="swiglu",
                                bias=True, norm="layernorm", position="learned", normalization="denominator"),
}


def _inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels[1, 3] = -100
    return ids, labels


def _documents(ids: torch.Tensor) -> Documents:
    """Packed documents with positions restarting in each (exercises per-row learned positions)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, 5] = starts[1, 11] = True
    index = torch.arange(ids.shape[1]).expand_as(ids)
    last_start = torch.where(starts, index, 0).cummax(dim=-1).values
    return Documents(starts, index - last_start)


def _run(model: GPT, ids: torch.Tensor, labels: torch.Tensor, documents: Documents | None) -> dict:
    out = model(ids, labels=labels, documents=documents)
    out.loss.backward()
    return {
        "logits": model.gather_logits(out.logits).detach(),
        "loss": out.loss.detach(),
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
    }


def _sp_worker(rank: int, world: int, tp: int, cp: int, name: str, with_documents: bool) -> dict:
    """The model built twice from the same seed on a TP x CP grid, without and with sequence parallelism."""
    state = ParallelState.create(tensor_parallel_size=tp, context_parallel_size=cp)
    config = ModelConfig(**CONFIGS[name])
    ids, labels = _inputs(SEQ)
    documents = _documents(ids) if with_documents else None
    if cp > 1:  # this rank's slice of every sequence (CP ranks of one TP group hold the same slice)
        ids, labels = sequence_slice(ids, state.cp_rank, cp), sequence_slice(labels, state.cp_rank, cp)
        if documents is not None:
            documents = Documents(*(sequence_slice(t, state.cp_rank, cp) for t in (documents.starts, documents.position_ids)))
    results = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = parallelize_gpt(GPT(config), state, seed=3, sequence_parallel=sp)
        with torch.no_grad():  # gains and biases start as constants: make them (and their gradients) generic
            gen = torch.Generator().manual_seed(2)
            for pname, p in model.named_parameters():
                if pname.endswith(("bias", "out_gain", "norm.weight")):
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        results[sp] = _run(model, ids, labels, documents)
        if sp:
            norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
            assert norms and all(type(m).__name__.startswith("SequenceParallel") for m in norms)
    return results


def _check(per_rank: list[dict], config: ModelConfig) -> None:
    for res in per_rank:
        off, on = res[False], res[True]
        # Both are the same TP computation except for the order of a few sums (the norms' and the
        # row-parallel biases' gradients add two shard sums instead of one sum over the sequence),
        # so each gradient is bounded on its own scale (tests/numerics.py), not the largest one's:
        # a gradient left unsummed over the shards is off by about half its size.
        steps = gpt_steps(config, SEQ) + SEQ + config.vocab_size
        grad_steps = gpt_steps(config, SEQ, backward=True) + 2 * (2 * SEQ + config.vocab_size)
        assert_close(on["logits"], off["logits"], steps=steps, name="logits")
        assert_close(on["loss"], off["loss"], steps=steps, name="loss")
        assert on["grads"].keys() == off["grads"].keys()
        for name, grad in off["grads"].items():
            assert normwise_scale(grad) > 0, name  # every parameter takes part
            assert_close(on["grads"][name], grad, steps=grad_steps, name=name)
    # replicated parameters end with the same (summed) gradient on both TP ranks
    for name, grad in per_rank[0][True]["grads"].items():
        if name.endswith(("norm.weight", "norm.bias", "proj.bias", "fc_out.bias", "pos_embed.weight")):
            assert torch.equal(grad, per_rank[1][True]["grads"][name]), name


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name,with_documents", [("flex_rms_rope", False), ("hedgehog_ln_learned", True)])
def test_sequence_parallel_equals_tensor_parallel(name: str, with_documents: bool) -> None:
    per_rank = run_distributed(_sp_worker, 2, args=(2, 1, name, with_documents))
    _check(per_rank, ModelConfig(**CONFIGS[name]))


@pytest.mark.slow
@pytest.mark.numerics
def test_sequence_parallel_composes_with_context_parallel() -> None:
    """TP=2 x CP=2 on 4 ranks: each CP slice is split again over the TP ranks."""
    per_rank = run_distributed(_sp_worker, 4, args=(2, 2, "hedgehog_ln_learned", False))
    _check(per_rank[:2], ModelConfig(**CONFIGS["hedgehog_ln_learned"]))
    _check(per_rank[2:], ModelConfig(**CONFIGS["hedgehog_ln_learned"]))


def _dropout_worker(rank: int, world: int) -> dict:
    state = ParallelState.create(tensor_parallel_size=2)
    config = ModelConfig(**dict(CONFIGS["flex_rms_rope"], hidden_dropout=0.5, attention_dropout=0.2))
    ids, labels = _inputs(SEQ)
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = parallelize_gpt(GPT(config), state, seed=3, sequence_parallel=True)
        model.set_activation_checkpointing(checkpointing)
        masks = []
        model.embed_dropout.register_forward_hook(lambda _m, args, out: masks.append((out == 0) & (args[0] != 0)))
        torch.manual_seed(5)
        results[checkpointing] = dict(_run(model, ids, labels, None), mask=masks[0])
    return results


@pytest.mark.slow
def test_dropout_on_sequence_shards_differs_per_rank_and_is_replayed_by_checkpointing() -> None:
    per_rank = run_distributed(_dropout_worker, 2)
    mask0, mask1 = per_rank[0][False]["mask"], per_rank[1][False]["mask"]
    assert mask0.shape == (2, SEQ // 2, 32) and 0.3 < mask0.float().mean() < 0.7
    # the same default RNG on both ranks would drop the same positions of both halves of the sequence
    assert not torch.equal(mask0, mask1)
    for res in per_rank:  # the recompute redraws every mask as in the forward: bit-equal gradients
        plain, recomputed = res[False], res[True]
        assert torch.equal(plain["mask"], recomputed["mask"])
        assert torch.equal(plain["loss"], recomputed["loss"])
        for name, grad in plain["grads"].items():
            assert torch.equal(recomputed["grads"][name], grad), name


# ----------------------------------------------------------------------------------------
# single process: factory and config
# ----------------------------------------------------------------------------------------
def test_local_layers_leave_the_residual_stream_whole() -> None:
    x = torch.randn(2, 5, 8)
    assert LocalLayers().scatter_sequence(x) is x


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_sequence_parallel_needs_tensor_parallel_ranks(norm: str) -> None:
    config = ModelConfig(vocab_size=64, num_layers=1, hidden_size=16, num_heads=2, feature_dim=8, norm=norm)
    with pytest.raises(ValueError, match="sequence_parallel: needs a tensor-parallel size > 1"):
        parallelize_gpt(GPT(config), ParallelState.single(), sequence_parallel=True)
    plain = GPT(config)
    norms = ("blocks.0.attn_norm", "blocks.0.mlp_norm", "final_norm")
    # without it, the TP model's norms are the plain modules (checkpoints never see a difference)
    model = parallelize_gpt(GPT(config), ParallelState.detached(2, 1), seed=0)
    assert [type(model.get_submodule(n)) for n in norms] == [type(plain.get_submodule(n)) for n in norms]
    # with it, their sequence-parallel versions holding the same parameters
    model = parallelize_gpt(GPT(config), ParallelState.detached(2, 1), seed=0, sequence_parallel=True)
    for name in norms:
        module = model.get_submodule(name)
        assert type(module).__name__.startswith("SequenceParallel") and isinstance(module, type(plain.get_submodule(name)))
        assert module.state_dict().keys() == plain.get_submodule(name).state_dict().keys()


def _config(tmp_path: Path, *overrides: str):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return load_config([path], list(overrides))


def test_config_sequence_parallel_defaults_off_and_is_validated(tmp_path: Path) -> None:
    assert _config(tmp_path).parallel.sequence_parallel is False
    cfg = _config(tmp_path, "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true")
    assert cfg.parallel.sequence_parallel is True
    # composes with context parallelism: seq 64 = CP 2 x TP 2 x 16
    _config(tmp_path, "parallel.tensor_parallel_size=2", "parallel.context_parallel_size=2", "parallel.sequence_parallel=true")
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel \(from command line\): needs "
                                          r"parallel.tensor_parallel_size > 1"):
        _config(tmp_path, "parallel.sequence_parallel=true")
    with pytest.raises(ConfigError, match=r"data.seq_len \(from command line\): expected a multiple of "
                                          r"parallel.context_parallel_size x tensor_parallel_size \(2 x 4\) "
                                          r"with parallel.sequence_parallel, got 36"):
        _config(tmp_path, "parallel.tensor_parallel_size=4", "parallel.context_parallel_size=2",
                "parallel.sequence_parallel=true", "data.seq_len=36")


@pytest.mark.parametrize("objective", [AttentionTransfer, Finetune])
def test_distillation_refuses_sequence_parallelism(tmp_path: Path, objective: type) -> None:
    cfg = _config(tmp_path, "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true")
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: distillation .* runs without sequence parallelism"):
        objective(cfg.distill).prepare(GPT(cfg.model), cfg)  # checked before the model is looked at
