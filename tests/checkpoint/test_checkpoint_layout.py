"""The checkpoint layout module: checksums name corrupt files, resume falls back past them,
the checkpoint dir is checked before training, eval finds a tag under a run dir (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaflex.eval.loading import resolve_checkpoint
from megaflex.checkpoint.layout import (
    FILES_KEY, META_FILE, CheckpointError, CorruptCheckpointError, auto_candidates, check_writable, prune_universal,
    rng_file, tag_for, universal_dir, verify_checkpoint, write_latest, write_meta,
)
from megaflex.checkpoint import CheckpointManager, CheckpointMeta, needs_repartition, preflight


def _fake_tag(ckpt: Path, step: int, payload: int = 1000) -> Path:
    """A committed tag as the trainer lays it out: a shard, an RNG file, metadata with checksums."""
    tag = ckpt / tag_for(step)
    tag.mkdir(parents=True)
    torch.save({"w": torch.arange(payload, dtype=torch.float32) * step}, tag / "mp_rank_00_model_states.pt")
    rng = rng_file(tag, 0)
    rng.parent.mkdir()
    torch.save({"torch": torch.get_rng_state()}, rng)
    write_meta(tag, {"iteration": step, "tokenizer": {"sha256": "extra keys are kept"}})
    write_latest(ckpt, tag.name)
    return tag


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_metadata_records_size_and_sha256_of_every_file(tmp_path: Path) -> None:
    tag = _fake_tag(tmp_path, 5)
    meta = json.loads((tag / META_FILE).read_text())
    assert sorted(meta[FILES_KEY]) == ["mp_rank_00_model_states.pt", "rng/rank_00000.pt"]
    assert meta[FILES_KEY]["mp_rank_00_model_states.pt"]["size"] == (tag / "mp_rank_00_model_states.pt").stat().st_size
    assert meta["tokenizer"] == {"sha256": "extra keys are kept"}
    assert verify_checkpoint(tag)["iteration"] == 5


def test_truncated_shard_and_metadata_are_named(tmp_path: Path) -> None:
    tag = _fake_tag(tmp_path, 5)
    shard = tag / "mp_rank_00_model_states.pt"
    _truncate(shard)
    with pytest.raises(CorruptCheckpointError, match=rf"corrupt checkpoint file {shard}: \d+ bytes, expected \d+"):
        verify_checkpoint(tag)
    rng = rng_file(tag, 0)
    data = bytearray(rng.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    rng.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="and 1 more"):
        verify_checkpoint(tag)
    _truncate(tag / META_FILE)
    with pytest.raises(CorruptCheckpointError, match=rf"corrupt checkpoint file {tag / META_FILE}: not valid JSON"):
        verify_checkpoint(tag)


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _fake_tag(tmp_path, step)
    assert [p.name for p in auto_candidates(tmp_path)] == ["step_00000015", "step_00000010", "step_00000005"]
    _truncate(tmp_path / "step_00000015" / "mp_rank_00_model_states.pt")
    _truncate(tmp_path / "step_00000010" / META_FILE)
    manager = CheckpointManager(tmp_path, keep_last=3, rank=0)
    warnings: list[str] = []
    path, meta = manager.select_resume("auto", warn=warnings.append)
    assert path == tmp_path / "step_00000005" and meta.iteration == 5
    assert "step_00000015/mp_rank_00_model_states.pt" in warnings[0]
    assert "step_00000010/megaflex.json: not valid JSON" in warnings[1]
    assert "resuming from the OLDER checkpoint" in warnings[2]
    # An explicit tag is never replaced by another one.
    with pytest.raises(CorruptCheckpointError, match="step_00000015/mp_rank_00_model_states.pt"):
        manager.select_resume("step_00000015", warn=warnings.append)
    # None intact: an error, not a silent fresh start.
    _truncate(tmp_path / "step_00000005" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="is intact"):
        manager.select_resume("auto", warn=warnings.append)


def test_unwritable_checkpoint_dir_is_refused_and_low_space_warned(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"checkpoint directory {blocker / 'ckpt'} is not writable"):
        check_writable(blocker / "ckpt")
    free = check_writable(tmp_path / "ok")
    assert free > 0 and not list((tmp_path / "ok").iterdir())  # the probe file is gone
    assert preflight(tmp_path / "ok", num_params=1000) is None
    warning = preflight(tmp_path / "ok", num_params=free)  # 16 bytes per parameter cannot fit
    assert warning is not None and "saves will fail with 'no space left'" in warning


def test_eval_finds_a_tag_under_a_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_tag(run / "checkpoints", 5)
    _fake_tag(run / "checkpoints", 10)
    assert resolve_checkpoint(run, "step_00000005") == run / "checkpoints" / "step_00000005"
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_00000010"
    assert resolve_checkpoint(run / "checkpoints", "step_00000005") == run / "checkpoints" / "step_00000005"
    with pytest.raises(ValueError, match=r"tag: 'step_00000007' is not a complete checkpoint .*step_00000010"):
        resolve_checkpoint(run, "step_00000007")


def test_zero_repartition_is_needed_only_for_another_dp_x_cp_count_and_refused_with_the_ways_out() -> None:
    path = Path("ckpt/step_00000010")
    saved = {"zero_stage": 1, "data_parallel_size": 1, "context_parallel_size": 2}
    meta = CheckpointMeta.from_dict(saved)
    # (stage, DP, CP, TP) of this run: the same DP x CP product or saved ZeRO 0 need nothing.
    assert not needs_repartition(meta, path, 1, 2, 1, 1, universal_allowed=False)
    assert not needs_repartition(CheckpointMeta.from_dict(dict(saved, zero_stage=0)), path, 1, 1, 1, 1, universal_allowed=False)
    assert needs_repartition(meta, path, 2, 1, 1, 1, universal_allowed=True)
    # written before context parallelism: no context_parallel_size (CP 1)
    assert needs_repartition(CheckpointMeta.from_dict({"zero_stage": 2, "data_parallel_size": 4}), path, 1, 1, 2, 1,
                             universal_allowed=True)
    assert needs_repartition(CheckpointMeta.from_dict(dict(saved, zero_stage=3)), path, 3, 1, 1, 1, universal_allowed=True)
    for run, allowed, why in [
        ((1, 1, 1, 1), False, "zero_universal_resume is off"),
        ((3, 1, 1, 1), True, "ZeRO 1/2 into ZeRO 1/2 and ZeRO 3 into ZeRO 3 only"),
        ((0, 1, 1, 1), True, "ZeRO 1/2 into ZeRO 1/2 and ZeRO 3 into ZeRO 3 only"),
        ((1, 1, 1, 2), True, "needs tensor_parallel_size 1"),
    ]:
        with pytest.raises(CheckpointError, match=why) as info:
            needs_repartition(meta, path, *run, universal_allowed=allowed)
        text = str(info.value)
        assert "over DP 1 x CP 2 = 2 ranks" in text and "DP 1 x CP 1 = 1, and" in text and "zero_stage=0" in text


def test_universal_copies_are_pruned_with_their_tags(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    _fake_tag(ckpt, 10)
    for step in (5, 10):
        universal_dir(ckpt, tag_for(step)).mkdir(parents=True)
    (universal_dir(ckpt, tag_for(15)).with_name(".tmp-" + tag_for(15))).mkdir()  # an interrupted conversion
    prune_universal(ckpt)
    assert sorted(p.name for p in (ckpt / "universal").iterdir()) == [tag_for(10)]
