"""``CheckpointMeta``: the typed ``megaflex.json`` writes the JSON the untyped dict wrote, and old
checkpoints (before context parallelism, optimizer groups and checksums) still load (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaflex.eval.loading import load_for_eval
from megaflex.checkpoint import (
    CheckpointError, CheckpointManager, CheckpointMeta, check_optimizer_groups, check_resume_layout,
    needs_repartition, parameter_shapes, save_weights_only,
)
from megaflex.checkpoint.layout import META_FILE, model_states_file, read_meta, write_latest, write_meta
from megaflex.checkpoint.metadata import LEGACY_MODEL_FIELDS
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from training_harness import TINY


def _trainer_meta(model: GPT) -> dict:
    """The dict megaflex-train wrote before ``CheckpointMeta`` existed, in its key order."""
    return {
        "iteration": 10, "consumed_samples": 80, "nonfinite_total": 0, "world_size": 2, "tensor_parallel_size": 1,
        "data_parallel_size": 2, "context_parallel_size": 1, "zero_stage": 1, "precision": "fp32",
        "parameter_shapes": parameter_shapes(model), "num_parameters": model.num_parameters(),
        "config": {"model": model.config.to_dict()}, "deepspeed_config": {"zero_optimization": {"stage": 1}},
        "optimizer_groups": ["decay", "no_decay", "kernel_frequency"],
        "sampler": {"consumed_samples": 80, "global_batch_size": 8}, "tokenizer": None, "init_from": None,
    }


def _old_meta(model: GPT) -> dict:
    """A checkpoint of an older megaflex: no CP size, optimizer groups, non-finite count, tokenizer,
    warm-start record or checksums."""
    meta = _trainer_meta(model)
    for key in ("context_parallel_size", "optimizer_groups", "nonfinite_total", "tokenizer", "init_from"):
        del meta[key]
    return meta


def _write_checkpoint(root: Path, model: GPT, meta: dict) -> Path:
    """``model``'s weights with metadata ``meta`` as the latest checkpoint under ``root``; its folder."""
    tag = root / "checkpoints" / "step_00000010"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, model_states_file(tag, 0))
    write_meta(tag, meta)
    write_latest(tag.parent, tag.name)
    return tag


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**TINY["model"]))


def test_trainer_weights_only_and_unknown_keys_round_trip_to_the_same_json(model: GPT) -> None:
    trainer = _trainer_meta(model)
    typed = CheckpointMeta.from_dict(trainer)
    assert typed.is_training_checkpoint and typed.cp_size == 1 and typed.zero_partitions == 2
    # Same keys in the same order, nulls included: byte-identical JSON, read back or built by the trainer.
    assert json.dumps(typed.to_dict()) == json.dumps(trainer)
    assert json.dumps(CheckpointMeta(**trainer).to_dict()) == json.dumps(trainer)
    imported = {"iteration": 3, "tensor_parallel_size": 1, "world_size": 1, "data_parallel_size": 1, "zero_stage": 0,
                "parameter_shapes": trainer["parameter_shapes"], "num_parameters": 1, "config": trainer["config"],
                "source": "megaflex-export --from-hf hf/x", "written_by_a_newer_megaflex": [1, 2]}
    typed = CheckpointMeta.from_dict(imported)
    assert not typed.is_training_checkpoint and typed.extra == {"written_by_a_newer_megaflex": [1, 2]}
    assert typed.to_dict() == imported and "tokenizer" not in typed.to_dict()  # weights only: no null fields
    with pytest.raises(CheckpointError, match=r"holds weights only \(written by megaflex-export --from-hf hf/x\)"):
        check_resume_layout(typed, Path("ck/step_3"), zero_stage=0, precision="fp32")


def test_files_table_is_written_by_write_meta_and_read_back(model: GPT, tmp_path: Path) -> None:
    tag = tmp_path / "step_00000010"
    tag.mkdir()
    torch.save({"module": model.state_dict()}, model_states_file(tag, 0))
    write_meta(tag, CheckpointMeta.from_dict(_trainer_meta(model)).to_dict())
    typed = CheckpointMeta.read(tag)
    assert sorted(typed.files) == [model_states_file(tag, 0).name]
    assert typed.to_dict() == read_meta(tag)  # the checksums travel through the typed form unchanged


def test_an_old_format_checkpoint_still_loads_and_resumes(model: GPT, tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    tag = ckpt / "step_00000010"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, model_states_file(tag, 0))
    (tag / META_FILE).write_text(json.dumps(_old_meta(model), indent=1))  # as written then: no "files"
    write_latest(ckpt, tag.name)

    path, meta = CheckpointManager(ckpt, keep_last=3, rank=0).select_resume("auto", warn=pytest.fail)
    assert path == tag and meta.iteration == 10 and meta.files is None
    assert meta.cp_size == 1 and meta.nonfinite_total is None and meta.tokenizer is None
    # Its meaning for a resume: CP 1, the two optimizer groups of its time, ZeRO 1 over DP 2.
    check_optimizer_groups(meta, ["decay", "no_decay"], path)
    with pytest.raises(ValueError, match=r"optimizer param groups \['decay', 'no_decay'\] differ"):
        check_optimizer_groups(meta, ["decay", "no_decay", "kernel_frequency"], path)
    check_resume_layout(meta, path, zero_stage=2, precision="fp32")
    assert not needs_repartition(meta, path, 1, 2, 1, 1, universal_allowed=False)
    assert json.loads(json.dumps(meta.to_dict())) == _old_meta(model)  # rewritten as it was read

    loaded = load_for_eval(tmp_path)  # a run directory: its checkpoints/ holds the tag
    assert loaded.path == tag and loaded.meta.iteration == 10
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name


def test_weights_only_save_commits_atomically_and_loads(model: GPT, tmp_path: Path) -> None:
    root = tmp_path / "merged"
    leftover = root / ".tmp-step_00000020"  # an interrupted earlier attempt at the same step
    leftover.mkdir(parents=True)
    (leftover / "partial.pt").write_bytes(b"x")
    meta = CheckpointMeta.from_dict(_trainer_meta(model))
    meta.iteration, meta.zero_stage, meta.lora_merged = 20, 0, True
    path = save_weights_only(root, 20, 0, model.state_dict(), meta, rank=0)
    assert path == root / "step_00000020" and sorted(p.name for p in root.iterdir()) == ["latest", "step_00000020"]
    assert sorted(CheckpointMeta.read(path).files) == [model_states_file(path, 0).name]  # nothing of the leftover
    loaded = load_for_eval(root)
    assert loaded.meta.lora_merged and loaded.meta.iteration == 20
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name


def test_a_window_hybrid_saved_before_window_mixing_loads_as_the_gated_blend(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gated = GPT(ModelConfig(**{**TINY["model"], "softmax_window": 8, "window_mixing": "gated"}))
    meta = _old_meta(gated)
    del meta["config"]["model"]["window_mixing"]  # as an older megaflex saved it
    tag = _write_checkpoint(tmp_path, gated, meta)
    assert CheckpointMeta.read(tag).model_config["window_mixing"] == "gated"
    loaded = load_for_eval(tmp_path)  # window_mix is a parameter of the gated blend only
    assert loaded.model.config.window_mixing == "gated"
    for name, value in gated.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    meta["config"]["model"]["window_mixing"] = "shared_normaliser"  # written today: taken as saved
    assert CheckpointMeta.from_dict(meta).model_config["window_mixing"] == "shared_normaliser"


def test_pipeline_checkpoints_resume_only_at_their_pipeline_size(model: GPT) -> None:
    meta = CheckpointMeta.from_dict(_trainer_meta(model))
    assert meta.pp_size == 1 and "pipeline_parallel_size" not in meta.to_dict()  # PP 1 writes nothing new
    check_resume_layout(meta, Path("ck/step_3"), zero_stage=1, precision="fp32")
    with pytest.raises(CheckpointError, match=r"pipeline_parallel_size=1, this run has 2.*pipeline_parallel_size=1"):
        check_resume_layout(meta, Path("ck/step_3"), zero_stage=1, precision="fp32", pp_size=2)
    staged = CheckpointMeta.from_dict({**_trainer_meta(model), "pipeline_parallel_size": 2})
    check_resume_layout(staged, Path("ck/step_3"), zero_stage=1, precision="fp32", pp_size=2)
    with pytest.raises(CheckpointError, match="not wired up for pipeline checkpoints"):
        needs_repartition(staged, Path("ck/step_3"), 1, 4, 1, 1, universal_allowed=True)  # DP 2 -> 4


def test_a_model_saved_before_the_capped_default_loads_with_the_rms_it_was_trained_with(tmp_path: Path) -> None:
    # Until capped_denominator became ModelConfig's default, "rms" was the default, and a model
    # config written before the field existed has no "normalization" key: such a checkpoint must
    # build the rms model it was trained with (its out_gain parameters), never the new default.
    assert ModelConfig(**{k: v for k, v in TINY["model"].items() if k != "normalization"}).normalization == "capped_denominator"
    torch.manual_seed(0)
    rms = GPT(ModelConfig(**{**TINY["model"], "normalization": "rms"}))
    with torch.no_grad():  # a trained gain, so that dropping it could not go unnoticed
        for block in rms.blocks:
            block.attn.out_gain.uniform_(0.5, 1.5)
    meta = _old_meta(rms)
    del meta["config"]["model"]["normalization"]  # as the older megaflex saved it
    tag = _write_checkpoint(tmp_path, rms, meta)
    assert CheckpointMeta.read(tag).model_config["normalization"] == "rms"
    loaded = load_for_eval(tmp_path)
    assert loaded.model.config.normalization == "rms"
    assert sorted(loaded.model.state_dict()) == sorted(rms.state_dict())
    tokens = torch.randint(0, TINY["model"]["vocab_size"], (2, 16))
    rms.eval()
    assert torch.equal(loaded.model(tokens).logits, rms(tokens).logits)  # same weights, same maths: bit-identical
    meta["config"]["model"]["normalization"] = "capped_denominator"  # written today: taken as saved
    assert CheckpointMeta.from_dict(meta).model_config["normalization"] == "capped_denominator"


def test_a_model_saved_before_the_issue_46_options_loads_with_what_it_was_trained_with(tmp_path: Path) -> None:
    # A checkpoint of a model config without the issue-46 options: no qk_norm field, feature_kwargs
    # without max_log_temperature (no temperature ceiling then). It must load as trained, whatever the
    # defaults become: qk_norm "none" (metadata.LEGACY_MODEL_FIELDS), and its tau, far above any
    # ceiling one might set today, unbounded: the same logits, bit for bit.
    torch.manual_seed(0)
    old = GPT(ModelConfig(**{**TINY["model"], **LEGACY_MODEL_FIELDS}))  # every field as it was then
    with torch.no_grad():
        for block in old.blocks:
            block.attn.core.feature_map.tau.fill_(6.0)  # 3.2 above its init log(2 sqrt 16) = 2.08
    meta = _old_meta(old)
    for field in LEGACY_MODEL_FIELDS:
        del meta["config"]["model"][field]  # as the older megaflex saved it
    assert meta["config"]["model"]["feature_kwargs"] == {}
    assert CheckpointMeta.from_dict(meta).model_config["qk_norm"] == "none"
    newer = {**meta, "config": {"model": {**meta["config"]["model"], "qk_norm": "rms"}}}
    assert CheckpointMeta.from_dict(newer).model_config["qk_norm"] == "rms"  # recorded: taken as saved
    _write_checkpoint(tmp_path, old, meta)
    loaded = load_for_eval(tmp_path)
    fmap = loaded.model.blocks[0].attn.core.feature_map
    assert fmap.max_log_temperature is None and torch.equal(fmap.log_temperature(), torch.full((4,), 6.0))
    tokens = torch.randint(0, TINY["model"]["vocab_size"], (2, 16))
    old.eval()
    assert torch.equal(loaded.model(tokens).logits, old(tokens).logits)


def test_a_model_saved_before_the_decay_loads_without_one(tmp_path: Path) -> None:
    # A model config written before model.kernel_decay existed has no such key: it loads without a decay
    # (no decay_logit), whatever ModelConfig's default becomes; one saved with the decay loads with it.
    torch.manual_seed(0)
    plain = GPT(ModelConfig(**TINY["model"], kernel_decay="none"))
    assert ModelConfig(**TINY["model"]).kernel_decay == "learned"  # today's default
    meta = _old_meta(plain)
    del meta["config"]["model"]["kernel_decay"]  # as an older megaflex saved it
    tag = _write_checkpoint(tmp_path / "old", plain, meta)
    assert CheckpointMeta.read(tag).model_config["kernel_decay"] == "none"
    loaded = load_for_eval(tmp_path / "old")
    assert loaded.model.config.kernel_decay == "none" and sorted(loaded.model.state_dict()) == sorted(plain.state_dict())
    decaying = GPT(ModelConfig(**{**TINY["model"], "kernel_decay": "learned"}))
    with torch.no_grad():
        for block in decaying.blocks:  # trained decays, so that dropping them could not go unnoticed
            block.attn.core.decay_logit.uniform_(0.0, 3.0)
    _write_checkpoint(tmp_path / "new", decaying, _trainer_meta(decaying))
    loaded = load_for_eval(tmp_path / "new")
    assert loaded.model.config.kernel_decay == "learned"
    tokens = torch.randint(0, TINY["model"]["vocab_size"], (2, 16))
    decaying.eval()
    assert torch.equal(loaded.model(tokens).logits, decaying(tokens).logits)
