"""Shared test set-up: the Triton interpreter switch and locating the real-text data set."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is first imported, and other test modules import it
# indirectly (torch, DeepSpeed) before the Triton tests are collected: set it before anything, so
# the kernels run under the interpreter on this GPU-less machine whatever the test order.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Only the compile tests need TorchDynamo (they switch it back on), but DeepSpeed's optimizer check imports its Muon module, whose
# @torch.compile decorators import TorchInductor: ~3 s of CPU per training process, hundreds of
# which the suite starts. Disabling TorchDynamo (inherited by every subprocess) skips that import
# and changes no computation here.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# TorchInductor's on-disk caches (default /tmp/torchinductor_$USER) do not key their C++ by
# ATEN_CPU_CAPABILITY: tests/run.sh's second pass (ATEN_CPU_CAPABILITY=default) would load the first
# pass's AVX-512 code and fail to build it. One cache per CPU-kernel setting, inherited by subprocesses.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), "megaflex-inductor-"
                 + os.environ.get("ATEN_CPU_CAPABILITY", "native") + "-" + os.environ.get("OPENBLAS_CORETYPE", "native")),
)

import pytest  # noqa: E402

if os.environ.get("MEGAFLEX_TEST_SEQUENTIAL_DOT") == "1":  # the interpreter's dots in the worst-case order
    import sequential_dot  # noqa: E402

    sequential_dot.install()

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """Directory of the shared real-text data (env MEGAFLEX_DATA, default ../shared/data)."""
    return Path(os.environ.get("MEGAFLEX_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = data_root()
    if not (root / "wikitext-2-raw" / "wiki.valid.raw").is_file():
        pytest.skip(f"real-text data not found at {root} (set MEGAFLEX_DATA); CI refuses to run without it")
    return root


@pytest.fixture
def forked_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's ``python -m`` subprocesses (and theirs) are forked from the fork server, not
    fresh interpreters: ~7 CPU seconds less each (tests/helpers/forked_python.py)."""
    from forked_python import fork_python_modules

    fork_python_modules(monkeypatch)
