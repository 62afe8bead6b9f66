"""The GPT under tensor parallelism equals the single-device GPT; checkpoint resharding is exact.

The TP=k models are loaded with the TP=1 model's weights resharded by
``megaflex.checkpoint.reshard``, so these tests check the layers, the model's sharded layouts
(fused QKV, SwiGLU, feature maps, per-head gains) and the resharding together.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.model.layers import LocalLayers, pad_vocab_size
from megaflex.parallel import ParallelState, TensorParallelLayers, parallelize_gpt
from megaflex.checkpoint.reshard import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    ShardSpec,
    export_safetensors,
    gpt_layout,
    load_state_dict_checked,
    main as reshard_main,
    merge_shards,
    reshard,
    split_state_dict,
)
from numerics import assert_close, gpt_steps, normwise_scale

VOCAB = 301  # not divisible by 2 or 4
SEQ = 13  # not a multiple of the chunk size
CONFIGS = {
    # Flexformer-N, tied embeddings, GELU, no bias
    "flex_tied": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                      feature_dim=16, chunk_size=8, max_seq_len=64),
    # Hedgehog (learnable per-head map), untied head, SwiGLU, biases, denominator normalisation
    "hedgehog_untied": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="hedgehog",
                            feature_dim=16, chunk_size=8, max_seq_len=64, tie_embeddings=False, mlp="swiglu",
                            bias=True, normalization="denominator"),
    # Flexformer-N with the one-normaliser softmax window (CP: a halo from the previous rank)
    "flex_window": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                        feature_dim=16, chunk_size=8, max_seq_len=64, softmax_window=6),
    # the window hybrid with issue 46's options: q/k norm before the forms, the learned far-field gain
    "flex_window_remedies": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                                 feature_dim=16, chunk_size=8, max_seq_len=64, softmax_window=6, qk_norm="rms",
                                 window_far_gain=True),
    # exact softmax attention with learned positions
    "softmax": dict(vocab_size=VOCAB, num_layers=1, hidden_size=32, num_heads=4, attention="softmax",
                    max_seq_len=64, position="learned"),
}


def _reference(name: str, seq: int = SEQ) -> dict:
    """TP=1 model (random, non-trivial weights), its outputs and its gradients on [2, seq] tokens."""
    config = ModelConfig(**CONFIGS[name])
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():  # perturb the gains/biases that are initialised to constants
        for pname, p in model.named_parameters():
            if pname.endswith(("bias", "out_gain", "norm.weight", "log_gain")):
                p.add_(0.1 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    ids[0, 0] = VOCAB - 1  # the last real token sits on the last (partly padded) shard
    labels = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels[1, 3] = -100
    out = model(ids, labels=labels)
    out.loss.backward()
    return {
        "config": CONFIGS[name],
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
        "ids": ids,
        "labels": labels,
        "logits": model.gather_logits(out.logits).detach(),
        "loss": out.loss.detach(),
    }


def _tp_worker(rank: int, world: int, tp: int, refs: list[dict]) -> list[dict]:
    state = ParallelState.create(tensor_parallel_size=tp)
    results = []
    for ref in refs:
        config = ModelConfig(**ref["config"])
        layout = gpt_layout(config)
        model = parallelize_gpt(GPT(config), state, seed=3)
        load_state_dict_checked(model, split_state_dict(ref["state_dict"], layout, tp)[state.tp_rank])
        out = model(ref["ids"], labels=ref["labels"])
        out.loss.backward()
        # Every parameter is this rank's shard (or a replica): the layout says which.
        for name, p in model.named_parameters():
            assert (layout[name].partition_dim is not None) == bool(getattr(p, "tensor_model_parallel", False)), name
        results.append({
            "logits": model.gather_logits(out.logits).detach(),
            "loss": out.loss.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        })
    return results


def _check_against_reference(refs: list[dict], per_rank: list[list[dict]], tp: int) -> None:
    world = len(per_rank)
    for i, ref in enumerate(refs):
        config = ModelConfig(**ref["config"])
        layout = gpt_layout(config)
        # error growth (tests/numerics.py): the model, the loss's token and vocabulary sums, the TP
        # all-reduces; gradients also sum over every (batch, token) position, all on the largest
        # gradient's scale (an entry near 0 carries its large terms' rounding)
        seq = ref["ids"].shape[-1]
        steps = gpt_steps(config, seq) + seq + config.vocab_size + tp
        grad_steps = gpt_steps(config, seq, backward=True) + 2 * (ref["ids"].numel() + config.vocab_size + tp)
        terms = max(normwise_scale(g) for g in ref["grads"].values())
        for rank in range(world):
            res = per_rank[rank][i]
            assert_close(res["logits"], ref["logits"], steps=steps, name="logits")
            assert_close(res["loss"], ref["loss"], steps=steps, name="loss")
        for group_start in range(0, world, tp):  # each data-parallel replica separately
            ranks = range(group_start, group_start + tp)
            param_layout = {k: layout[k] for k in ref["grads"]}
            grads = merge_shards([per_rank[r][i]["grads"] for r in ranks], param_layout)
            assert grads.keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                assert_close(grads[name], grad, steps=grad_steps, floor=terms, name=name)
            # the loaded shards merge back to the original weights exactly
            weights = merge_shards([per_rank[r][i]["state_dict"] for r in ranks], layout)
            for name, value in ref["state_dict"].items():
                assert torch.equal(weights[name], value), name


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_tp2_dp2_equals_tp1() -> None:
    refs = [_reference(name) for name in ("flex_tied", "hedgehog_untied", "flex_window_remedies")]
    _check_against_reference(refs, run_distributed(_tp_worker, 4, args=(2, refs)), tp=2)


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_tp4_equals_tp1() -> None:
    refs = [_reference(name) for name in ("flex_tied", "softmax")]
    _check_against_reference(refs, run_distributed(_tp_worker, 4, args=(4, refs)), tp=4)


# ----------------------------------------------------------------------------------------
# single process: layout, resharding, export, errors
# ----------------------------------------------------------------------------------------
def test_layout_of_gpt() -> None:
    layout = gpt_layout(ModelConfig(**CONFIGS["hedgehog_untied"]))
    assert layout["embed.weight"] == ShardSpec(0, VOCAB)
    assert layout["lm_head.weight"] == ShardSpec(0, VOCAB)
    assert layout["blocks.0.attn.qkv.weight"] == ShardSpec(0)
    assert layout["blocks.0.attn.qkv.bias"] == ShardSpec(0)
    assert layout["blocks.0.attn.proj.weight"] == ShardSpec(1)
    assert layout["blocks.0.attn.proj.bias"] == ShardSpec(None)  # added after the all-reduce
    assert layout["blocks.0.attn.core.feature_map.W"] == ShardSpec(0)  # heads on dim 0
    assert "blocks.0.attn.out_gain" not in layout  # only with "rms" normalisation
    assert layout["blocks.1.mlp.fc_out.weight"] == ShardSpec(1)
    assert layout["final_norm.weight"] == ShardSpec(None)
    flex = gpt_layout(ModelConfig(**CONFIGS["flex_tied"]))
    assert {flex[f"blocks.0.attn.core.feature_map.{p}"] for p in ("omega1", "omega2", "tau")} == {ShardSpec(0)}
    assert "blocks.0.attn.out_gain" not in flex  # the default capped_denominator has no gains
    flex_rms = gpt_layout(ModelConfig(**CONFIGS["flex_tied"], normalization="rms"))
    assert flex_rms["blocks.0.attn.out_gain"] == ShardSpec(0)  # per-head gains: heads on dim 0
    # one head: no TP>1 skeleton exists; the layout comes from the partition tags
    single = gpt_layout(ModelConfig(**dict(CONFIGS["flex_tied"], num_heads=1)))
    assert single["embed.weight"] == ShardSpec(0, VOCAB)
    assert single["blocks.0.attn.proj.weight"] == ShardSpec(1)
    assert single["final_norm.weight"] == ShardSpec(None)


@pytest.mark.parametrize("name", ["flex_tied", "hedgehog_untied"])
def test_reshard_round_trip_is_exact(name: str) -> None:
    config = ModelConfig(**CONFIGS[name])
    torch.manual_seed(0)
    model = GPT(config)
    original = model.state_dict()
    layout = gpt_layout(config)

    tp2 = split_state_dict(original, layout, 2)
    assert tp2[0]["embed.weight"].shape == (pad_vocab_size(VOCAB, 2) // 2, 32)
    assert tp2[1]["blocks.0.attn.qkv.weight"].shape == (48, 32)
    tp4 = reshard(tp2, layout, 4)
    assert tp4[3]["blocks.0.mlp.fc_in.weight"].shape[0] == config.ffn_hidden_size * (2 if config.mlp == "swiglu" else 1) // 4
    back = reshard(tp4, layout, 1)[0]
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    # shard contents are the slices of the full tensor, heads/vocab rows in order
    omega_or_w = next(k for k in layout if ".feature_map." in k)
    assert torch.equal(tp4[2][omega_or_w], original[omega_or_w][2:3])
    assert torch.equal(tp4[1]["embed.weight"], original["embed.weight"][128:256])  # 128 rows per rank at TP=4
    assert torch.equal(tp4[2]["embed.weight"][: VOCAB - 256], original["embed.weight"][256:VOCAB])
    assert torch.all(tp4[3]["embed.weight"] == 0)  # pure padding, past TP=1's padded size

    reloaded = GPT(config)
    load_state_dict_checked(reloaded, back)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


PARALLELIZE_CONFIGS = {
    "flex_tied": CONFIGS["flex_tied"],
    "flex_untied_swiglu": dict(CONFIGS["flex_tied"], tie_embeddings=False, mlp="swiglu", bias=True),
    "flex_window": CONFIGS["flex_window"],
    # gated window mixing and a q/k/v convolution: per-head core tensors besides the feature map
    "flex_window_gated_conv": dict(CONFIGS["flex_window"], window_mixing="gated", qkv_conv_size=3),
    "hedgehog_untied": CONFIGS["hedgehog_untied"],
    # per-head tensors of the attention layer besides the core: the q/k norm's gains and biases
    "flex_qk_norm": dict(CONFIGS["flex_tied"], qk_norm="affine_rms"),
    "flex_window_far_gain": dict(CONFIGS["flex_window"], window_far_gain=True),
}


def _expected_shard(full: dict[str, torch.Tensor], config: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s shard of a plain GPT's state dict, by name (Megatron's layout, written
    out independently of ``gpt_layout``, which is itself derived through ``parallelize_gpt``)."""
    out = {}
    for name, t in full.items():
        if name in ("embed.weight", "lm_head.weight"):  # zero padding rows up to the TP-padded vocab
            table = torch.zeros(pad_vocab_size(config.vocab_size, tp), t.shape[1])
            table[: t.shape[0]] = t
            out[name] = table.chunk(tp)[rank]
        elif name.endswith(("qkv.weight", "qkv.bias", "fc_in.weight", "fc_in.bias", "out_gain")):
            out[name] = t.chunk(tp)[rank]  # column-parallel outputs, per-head gains
        elif ".core." in name or ".qk_norm." in name:
            assert t.shape[0] == config.num_heads, name  # every core and q/k-norm tensor is per head (dim 0)
            out[name] = t.chunk(tp)[rank]
        elif name.endswith(("proj.weight", "fc_out.weight")):
            out[name] = t.chunk(tp, dim=1)[rank]  # row-parallel inputs
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("name", sorted(PARALLELIZE_CONFIGS))
def test_parallelize_gpt_holds_the_plain_models_slices(name: str) -> None:
    """Build plain, then parallelise: every parameter and buffer of TP rank r is rank r's slice of
    the plain model built from the same seed, the default RNG is left where the plain build left
    it, and the model runs through the TP factory with its head-sharded tensors tagged."""
    config = ModelConfig(**PARALLELIZE_CONFIGS[name])
    torch.manual_seed(5)
    full = {k: v.clone() for k, v in GPT(config).state_dict().items()}
    after_plain = torch.rand(4)
    for tp_rank in range(2):
        torch.manual_seed(5)
        model = parallelize_gpt(GPT(config), ParallelState.detached(2, tp_rank), seed=0)
        assert torch.equal(torch.rand(4), after_plain)  # parallelising drew nothing from the default RNG
        shard, expected = model.state_dict(), _expected_shard(full, config, 2, tp_rank)
        assert shard.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(shard[key], value), key
        factories = {id(m.layer_factory) for m in model.modules() if hasattr(m, "layer_factory")}
        assert factories == {id(model.layer_factory)} and isinstance(model.layer_factory, TensorParallelLayers)
        assert all(block.attn.local_heads == config.num_heads // 2 for block in model.blocks)
        for key, p in model.named_parameters():
            if ".core." in key or ".qk_norm." in key or key.endswith("out_gain"):
                assert p.tensor_model_parallel and p.partition_dim == 0, key


def test_parallelize_gpt_leaves_a_single_rank_model_plain() -> None:
    config = ModelConfig(**CONFIGS["flex_tied"])
    model = GPT(config)
    modules = dict(model.named_modules())
    assert parallelize_gpt(model, ParallelState.single()) is model
    assert dict(model.named_modules()) == modules and type(model.layer_factory) is LocalLayers
    with pytest.raises(ValueError, match="ffn_hidden_size: expected a multiple of the tensor-parallel size 4, got 66"):
        parallelize_gpt(GPT(ModelConfig(**dict(CONFIGS["flex_tied"], ffn_hidden_size=66))), ParallelState.detached(4, 0))


def test_bad_tp_and_shape_errors() -> None:
    config = ModelConfig(**CONFIGS["flex_tied"])
    with pytest.raises(ValueError, match="num_heads: expected a multiple of the tensor-parallel size 3, got 4"):
        parallelize_gpt(GPT(config), ParallelState.detached(3, 0), seed=0)
    layout = gpt_layout(config)
    torch.manual_seed(0)
    shards = split_state_dict(GPT(config).state_dict(), layout, 2)
    with pytest.raises(ValueError, match=r"embed\.weight: checkpoint shape \(256, 32\) does not match the model's \(384, 32\)"):
        load_state_dict_checked(GPT(config), shards[0])
    with pytest.raises(ValueError, match=r"state_dict: keys do not match.*missing \['final_norm.weight'\]"):
        load_state_dict_checked(GPT(config), {k: v for k, v in merge_shards(shards, layout).items() if k != "final_norm.weight"})
    with pytest.raises(ValueError, match="cannot be split over tp_size=3"):
        split_state_dict(merge_shards(shards, layout), layout, 3)
    bad = [dict(shards[0]), dict(shards[1])]
    bad[1]["blocks.0.attn.proj.weight"] = bad[1]["blocks.0.attn.proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.proj\.weight: shards have different shapes"):
        merge_shards(bad, layout)


def test_safetensors_export_and_cli(tmp_path) -> None:
    config = ModelConfig(**CONFIGS["hedgehog_untied"])
    torch.manual_seed(0)
    model = GPT(config)
    layout = gpt_layout(config)
    original = model.state_dict()

    # A checkpoint tag as megaflex.checkpoint writes it, at TP=2.
    tag = tmp_path / "step_00000010"
    tag.mkdir()
    for rank, sd in enumerate(split_state_dict(original, layout, 2)):
        torch.save({"module": sd}, tag / f"mp_rank_{rank:02d}_model_states.pt")
    meta = {"tensor_parallel_size": 2, "config": {"model": config.to_dict()},
            "parameter_shapes": {k: list(p.shape) for k, p in model.named_parameters()}}
    (tag / "megaflex.json").write_text(json.dumps(meta))

    reshard_main([str(tag), str(tmp_path / "tp4"), "--tp", "4"])
    new_meta = json.loads((tmp_path / "tp4" / "megaflex.json").read_text())
    assert new_meta["tensor_parallel_size"] == 4
    tp4 = [torch.load(tmp_path / "tp4" / f"mp_rank_{r:02d}_model_states.pt")["module"] for r in range(4)]
    assert new_meta["parameter_shapes"]["blocks.0.attn.qkv.weight"] == list(tp4[0]["blocks.0.attn.qkv.weight"].shape)
    merged = merge_shards(tp4, layout)

    reshard_main([str(tmp_path / "tp4"), str(tmp_path / "export"), "--safetensors"])
    exported = load_file(str(tmp_path / "export" / SAFETENSORS_FILE))
    config_dict = json.loads((tmp_path / "export" / CONFIG_FILE).read_text())
    assert ModelConfig.from_dict(config_dict) == config
    for key, value in original.items():
        assert torch.equal(exported[key], value) and torch.equal(merged[key], value), key
    # The resharded tag records its own shards' checksums; a damaged shard is named, not unpickled.
    from megaflex.checkpoint.layout import CorruptCheckpointError, verify_checkpoint

    assert sorted(verify_checkpoint(tmp_path / "tp4")["files"]) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]
    shard = tmp_path / "tp4" / "mp_rank_03_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=f"corrupt checkpoint file {shard}: 100 bytes"):
        reshard_main([str(tmp_path / "tp4"), str(tmp_path / "export2"), "--safetensors"])
    export_safetensors(original, config, tmp_path / "direct")  # tied weights / views are fine too
    assert torch.equal(load_file(str(tmp_path / "direct" / SAFETENSORS_FILE))["embed.weight"], original["embed.weight"])
