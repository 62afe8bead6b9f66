"""Building the sample index at start-up cannot trip the collective timeout: rank 0 builds it while
the other ranks wait on a gloo group with ``INDEX_BUILD_TIMEOUT`` (megaflex.training.data), not at a
barrier of the default group, whose ``parallel.timeout_minutes`` a large corpus outlasts."""

from __future__ import annotations

import contextlib
import copy
import io
import time
from pathlib import Path

import numpy as np
import pytest

from distributed import run_distributed
from data_files import make_dataset
from training_harness import TINY, write_config

BUILD_S = 6.0  # rank 0's index build, twice the collective timeout below


def _rank(rank: int, world_size: int, config: str) -> tuple[bool, bytes, str]:
    import megaflex.data.gpt_dataset as gpt_dataset
    import megaflex.training.data as training_data
    from megaflex.training.collective_timeout import apply_timeout
    from megaflex.training.config import load_config

    apply_timeout(BUILD_S / 2 / 60)  # the default group's collective timeout: 3 s
    training_data.INDEX_WAIT_REPORT_S = 1.0
    build = gpt_dataset.build_indices

    def slow_build(*args, **kwargs):  # a large corpus
        time.sleep(BUILD_S)
        return build(*args, **kwargs)

    gpt_dataset.build_indices = slow_build
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train, _ = training_data.build_datasets(load_config([config]), 40, 0, rank)
    samples = np.stack([train[i] for i in range(len(train))]).tobytes()
    return train.dataset.built_indices, samples, out.getvalue()


@pytest.mark.slow
def test_an_index_build_longer_than_the_collective_timeout_is_waited_for(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "d", 200, seed=0)
    config = copy.deepcopy(TINY)
    config["model"]["vocab_size"] = 8192  # make_dataset's ids are stream positions
    config["data"] = {"source": "indexed", "seq_len": 8, "train_path": [str(data.prefix)], "split": "1,0,0",
                      "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    path = write_config(tmp_path / "cfg.yaml", config)
    (built0, samples0, out0), (built1, samples1, out1) = run_distributed(_rank, 2, args=(str(path),), timeout=120)
    assert (built0, built1) == (True, False)  # rank 1 loaded what rank 0 built
    assert samples0 == samples1
    assert "rank 1: waiting for rank 0 to build the sample indices" in out1 and out0 == ""
