"""The training loop does not wait on the device per micro-batch (issue 20, finding 6).

Every device-to-host read (``Tensor.item``/``cpu``/``tolist``/``numpy``/``__float__``/
``__int__``/``__bool__``) made on the main thread is counted during a real one-rank ZeRO-1 bf16
run; the counts are cut at each step's start (``lr_at``) and each micro-batch's fetch. On the
GPU each such read stalls Python until the device catches up, so: none between the micro-batches
of a step, and a small fixed number per step (the agreed flags; DeepSpeed's own overflow and
norm checks), with the losses read only on logged steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training_harness import REPO, TINY, base_env

COUNTER = r'''
import json, sys, threading
import torch
import megaflex.training.trainer as trainer
import megaflex.training.batches as data

main_thread, reads, ours, marks = threading.get_ident(), [0], [0], []
CPU_KERNEL = "megaflex/attention/linear/chunk.py"  # CPU-only path: on CUDA the Triton kernels run, read-free

def caller_files():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame.f_code.co_filename
        frame = frame.f_back

for name in ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__"):
    original = getattr(torch.Tensor, name)
    def counted(self, *a, _original=original, **k):
        if threading.get_ident() == main_thread:
            files = list(caller_files())
            if not any(f.endswith(CPU_KERNEL) for f in files):
                reads[0] += 1
                ours[0] += "/megaflex/" in files[0]  # read by megaflex itself (not DeepSpeed)
        return _original(self, *a, **k)
    setattr(torch.Tensor, name, counted)

real_lr_at, real_next = trainer.lr_at, data.Prefetcher.__next__
def lr_at(cfg, iteration):
    marks.append(("step", iteration, reads[0], ours[0]))
    return real_lr_at(cfg, iteration)
def fetch(self):
    marks.append(("batch", None, reads[0], ours[0]))
    return real_next(self)
trainer.lr_at, data.Prefetcher.__next__ = lr_at, fetch

from megaflex.training.train import main
status = main(sys.argv[1:])
marks.append(("end", None, reads[0], ours[0]))
print("MARKS " + json.dumps(marks))
sys.exit(status)
'''

STEPS, ACCUM = 6, 4


def _per_step_reads(tmp_path: Path) -> tuple[list[int], list[int], list[int]]:
    cfg = dict(TINY, logging=dict(TINY["logging"], kernel_stats_interval=0, log_interval=1000))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    overrides = [
        f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", f"train.train_iters={STEPS}",
        "parallel.zero_stage=1", "train.precision=bf16", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
        "train.eval_interval=0", f"train.global_batch_size={2 * ACCUM}",
    ]
    proc = subprocess.run([sys.executable, "-c", COUNTER, "--config", str(config), *overrides], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    marks = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MARKS "))[6:])
    steps = [(i, m) for i, m in enumerate(marks) if m[0] == "step"]
    assert [m[1] for _, m in steps] == list(range(STEPS))
    per_step = [steps[k + 1][1][2] - steps[k][1][2] for k in range(STEPS - 1)]
    ours_per_step = [steps[k + 1][1][3] - steps[k][1][3] for k in range(STEPS - 1)]
    # within a step: from one micro-batch's fetch to the next (the boundary comes after the last)
    within = []
    for i, _ in steps:
        fetches = [m[2] for m in marks[i + 1:] if m[0] == "batch"][:ACCUM]
        within += [b - a for a, b in zip(fetches, fetches[1:])]
    return per_step, ours_per_step, within


@pytest.mark.slow
def test_no_host_read_per_micro_batch_and_few_per_step(tmp_path: Path) -> None:
    per_step, ours, within = _per_step_reads(tmp_path)
    assert len(within) == STEPS * (ACCUM - 1)
    assert within == [0] * len(within), f"device-to-host reads between micro-batches: {within}"
    # Steps 1..5 log nothing (log_interval 1000): megaflex reads the step's agreed flags once;
    # DeepSpeed's bf16 optimizer adds its own overflow / norm checks.
    assert ours == [1] * (STEPS - 1), f"megaflex's device-to-host reads per step: {ours}"
    assert max(per_step) <= 4, f"device-to-host reads per step (with DeepSpeed's): {per_step}"


def test_prefetcher_keeps_order_and_raises_in_place() -> None:
    import torch

    from megaflex.data.indexed import DataError
    from megaflex.training.batches import Prefetcher

    def source():
        for i in range(5):
            if i == 3:
                raise DataError("sample 3: token id 999 >= vocab_size 256")
            yield torch.full((2,), i), torch.full((2,), -i)

    batches = Prefetcher(source(), "cpu")
    got = [next(batches)[0].tolist() for _ in range(3)]
    assert got == [[0, 0], [1, 1], [2, 2]]
    with pytest.raises(DataError, match="sample 3"):
        next(batches)
    done = Prefetcher(iter([(torch.zeros(1),)]), "cpu")
    assert len(list(done)) == 1 and list(done) == []  # exhausted stays exhausted
    done.close()


def test_prefetcher_close_waits_for_its_reader_thread() -> None:
    """``close`` returns only once the reader has stopped, also mid-read: a daemon thread still
    inside an ATen op at interpreter exit aborts the process (exit -6 instead of the run's code)."""
    import threading

    import torch

    from megaflex.training.batches import Prefetcher

    reading = threading.Event()

    def slow_source():
        for i in range(1000):
            if i == 3:  # the queue (depth 2) is full: the reader is held here, inside the source
                reading.set()
                torch.randn(64, 64) @ torch.randn(64, 64)
                threading.Event().wait(0.5)
            yield (torch.full((2,), i),)

    with Prefetcher(slow_source(), "cpu") as batches:
        assert next(batches)[0].tolist() == [0, 0]
        assert reading.wait(10)
    assert not batches._thread.is_alive()
