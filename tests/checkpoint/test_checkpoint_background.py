"""Background checkpoint saves (``checkpoint.background``) keep every guarantee of the synchronous save.

In-process, one rank: an engine stand-in that saves through a DeepSpeed-style checkpoint engine
(``save_checkpoint`` -> ``checkpoint_engine.makedirs`` / ``.save(state, path)``), whose writes a test
can hold back (a gate) or fail. The last test runs real DeepSpeed engines on 2 ranks (slow): the
background save writes the same bytes as the synchronous one. The trainer-level guarantees (kill -9
mid-write, SIGTERM mid-write, disk full, the final save waited for) are in tests/training/.
"""

from __future__ import annotations

import errno
import io
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from megaflex.checkpoint import CheckpointError, CheckpointManager, CheckpointMeta, complete_tags
from megaflex.checkpoint.background import host_copy
from megaflex.checkpoint.layout import TMP_PREFIX, read_latest, read_meta, tag_for, tmp_dir, verify_checkpoint
from megaflex.checkpoint.manager import WRITE_DONE, WRITE_FAILED, WRITE_IN_FLIGHT

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class GatedCheckpointEngine:
    """DeepSpeed's TorchCheckpointEngine as the manager uses it; ``gate`` holds writes back, ``error`` fails them."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.error: BaseException | None = None
        self.log = log

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.gate.wait()
        if self.error is not None:
            raise self.error
        torch.save(state_dict, path)
        self.log.append(("write", Path(path).name))


class Engine:
    """What ``CheckpointManager.save`` needs of a DeepSpeed engine: ``save_checkpoint`` through ``checkpoint_engine``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.checkpoint_engine = GatedCheckpointEngine(self.log)
        self.weights = torch.arange(1000, dtype=torch.float32)
        self.moments = {"exp_avg": torch.ones(1000), "step": torch.tensor(3.0)}

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        self.log.append(("capture", tag.removeprefix(TMP_PREFIX)))  # the manager saves into .tmp-<tag>
        folder = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(str(folder), exist_ok=True)
        self.checkpoint_engine.save({"module": {"w": self.weights}}, str(folder / MODEL_FILE))
        self.checkpoint_engine.save({"optimizer_state_dict": self.moments}, str(folder / OPTIM_FILE))

    def train(self) -> None:
        """An optimizer step: the live tensors change in place."""
        self.weights.add_(1.0)
        self.moments["exp_avg"].mul_(0.5)


def _manager(root: Path, engine: Engine, background: bool = True) -> CheckpointManager:
    manager = CheckpointManager(root, keep_last=5, rank=0, background=background)
    manager.before_commit = lambda it: engine.log.append(("commit", it))
    return manager


def _save(manager: CheckpointManager, engine: Engine, step: int) -> Path | None:
    return manager.save(engine, step, CheckpointMeta(iteration=step, consumed_samples=8 * step), None)


def _serialized(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_host_copy_serializes_to_the_bytes_of_the_state_when_copied() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    leaf = torch.ones(3, requires_grad=True)
    partition = torch.zeros(4)
    partition.ds_id = "0_19"  # a Python attribute, as ZeRO 3 sets on its flat partitions
    betas = (0.9, 0.95)  # one tuple shared by every param group, as torch.optim's defaults are
    state = OrderedDict(
        flat=flat, view=flat[2:8].view(2, 3),  # two views of one storage: one storage in the file
        same=flat,  # the same tensor object again: pickled once, then referenced
        param=torch.nn.Parameter(torch.full((2,), 5.0)), non_leaf=leaf * 2, partition=partition,
        empty=(torch.empty(0), torch.empty(0)), shape=torch.Size([2, 3]), step=7,
        param_groups=[{"lr": 0.1, "betas": betas}, {"lr": 0.2, "betas": betas}],
    )
    before = _serialized(state)
    copied = host_copy(state)
    flat.add_(100.0)  # training goes on: the copy keeps the values of the moment it was taken
    state["param"].data.mul_(2.0)
    partition.add_(1.0)
    assert _serialized(copied) == before
    assert copied["view"].untyped_storage().data_ptr() == copied["flat"].untyped_storage().data_ptr()
    assert copied["flat"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def test_a_background_save_is_published_only_when_complete(tmp_path: Path) -> None:
    engine = Engine()
    manager = _manager(tmp_path, engine)
    _save(manager, engine, 5)
    assert manager.finish() == tmp_path / tag_for(5)
    saved_weights = engine.weights.clone()

    engine.checkpoint_engine.gate.clear()  # the writer thread stops at its first file
    assert _save(manager, engine, 10) is None  # returned with the state copied, nothing written yet
    engine.train()  # the next steps run meanwhile
    assert manager.writer_status() == WRITE_IN_FLIGHT
    assert manager.advance(WRITE_IN_FLIGHT) is None  # a rank still writing: no commit
    assert tmp_dir(tmp_path, tag_for(10)).is_dir()
    assert complete_tags(tmp_path) == [tag_for(5)] and read_latest(tmp_path) == tag_for(5)
    path, meta = manager.select_resume("auto", warn=pytest.fail)  # --resume auto skips the incomplete save
    assert path == tmp_path / tag_for(5) and meta.iteration == 5

    engine.checkpoint_engine.gate.set()
    manager.pending.write.wait()
    assert manager.writer_status() == WRITE_DONE
    assert manager.advance(WRITE_DONE) == tmp_path / tag_for(10)
    assert complete_tags(tmp_path) == [tag_for(5), tag_for(10)] and read_latest(tmp_path) == tag_for(10)
    assert not tmp_dir(tmp_path, tag_for(10)).exists()
    meta = verify_checkpoint(tmp_path / tag_for(10))  # every file's size and SHA-256 recorded and checked
    assert sorted(meta["files"]) == [MODEL_FILE, "rng/rank_00000.pt", OPTIM_FILE]
    assert meta["iteration"] == 10 and meta["consumed_samples"] == 80
    written = torch.load(tmp_path / tag_for(10) / MODEL_FILE, weights_only=False)["module"]["w"]
    assert torch.equal(written, saved_weights)  # the state at step 10, not after the later step
    assert not torch.equal(written, engine.weights)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_writer_takes_only_idle_cpu(tmp_path: Path) -> None:
    engine = Engine()
    manager = _manager(tmp_path, engine)
    seen, own = [], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    manager.during_write = lambda it: seen.append((it, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    _save(manager, engine, 10)
    manager.finish()
    assert seen == [(10, 19)]  # on the writer thread, after its first file: the lowest priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the training thread's is untouched


def test_a_second_save_waits_for_the_first_to_be_committed(tmp_path: Path) -> None:
    engine = Engine()
    manager = _manager(tmp_path, engine)
    engine.checkpoint_engine.gate.clear()
    _save(manager, engine, 10)
    release = threading.Timer(0.2, engine.checkpoint_engine.gate.set)  # the first write ends later
    release.start()
    _save(manager, engine, 20)
    manager.finish()
    release.join()
    events = engine.log
    assert events.index(("commit", 10)) < events.index(("capture", tag_for(20)))
    assert [e for e in events if e[0] != "write"] == [("capture", tag_for(10)), ("commit", 10),
                                                      ("capture", tag_for(20)), ("commit", 20)]
    assert complete_tags(tmp_path) == [tag_for(10), tag_for(20)]


@pytest.mark.parametrize("wait", ["at a step boundary", "finish"])
def test_a_failed_background_write_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path: Path, wait: str) -> None:
    engine = Engine()
    manager = _manager(tmp_path, engine)
    _save(manager, engine, 5)
    manager.finish()
    engine.checkpoint_engine.error = OSError(errno.ENOSPC, "No space left on device")
    _save(manager, engine, 10)
    with pytest.raises(CheckpointError) as info:
        if wait == "finish":
            manager.finish()
        else:
            manager.pending.write.wait()
            assert manager.writer_status() == WRITE_FAILED
            manager.advance(WRITE_FAILED)
    assert str(info.value) == (
        f"saving the checkpoint of step 10 failed: no space left on {tmp_path}; removed the partial .tmp-step_00000010; "
        f"the previous checkpoint {tmp_path / tag_for(5)} is kept. Free space (or set checkpoint.dir) and resume with "
        "--resume auto"
    )
    assert not tmp_dir(tmp_path, tag_for(10)).exists()
    assert complete_tags(tmp_path) == [tag_for(5)] and read_latest(tmp_path) == tag_for(5)
    assert manager.pending is None and manager.finish() is None  # reported once


def test_another_rank_s_failure_is_named_as_such(tmp_path: Path) -> None:
    engine = Engine()
    manager = _manager(tmp_path, engine)
    _save(manager, engine, 10)
    manager.pending.write.wait()
    assert manager.writer_status() == WRITE_DONE  # this rank wrote its files; the agreed status says another failed
    with pytest.raises(CheckpointError, match=f"another rank failed to write to {tmp_path}; .* no earlier checkpoint exists"):
        manager.advance(WRITE_FAILED)
    assert complete_tags(tmp_path) == []


# ------------------------------------------------------------------------------- real DeepSpeed engines
def _sync_and_background_manifests(rank: int, world: int, root: str, zero_stage: int, precision: str) -> list[dict]:
    import deepspeed

    from megaflex.model.config import ModelConfig
    from megaflex.model.gpt import GPT
    from megaflex.training.deepspeed_config import init_deepspeed_distributed

    init_deepspeed_distributed("gloo")  # adopts the existing process group
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                            attention="flexformer_n", feature_dim=32, chunk_size=32, max_seq_len=64))
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2**31 - 1,
              "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": precision == "bf16"},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    decay = [p for p in model.parameters() if p.dim() > 1]
    groups = [{"params": decay}, {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)  # two param groups share the default betas tuple
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(ids, ids).loss)
    engine.step()
    manifests = []
    for background in (False, True):
        manager = CheckpointManager(Path(root) / f"background_{background}", keep_last=2, rank=rank, background=background)
        torch.manual_seed(1)  # the same RNG state in both files
        manager.save(engine, 1, CheckpointMeta(iteration=1, consumed_samples=2 * world), None)
        manager.finish()
        manifests.append(read_meta(manager.ckpt_dir / tag_for(1))["files"])
    return manifests


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,precision", [(1, "bf16"), (3, "fp32")])
def test_background_save_writes_the_bytes_of_the_synchronous_save(tmp_path: Path, zero_stage: int, precision: str) -> None:
    from distributed import run_distributed

    sync, background = run_distributed(_sync_and_background_manifests, world_size=2,
                                       args=(str(tmp_path), zero_stage, precision))[0]
    assert background == sync  # every file of both ranks: same names, sizes and SHA-256
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(sync) and len(sync) >= 4
