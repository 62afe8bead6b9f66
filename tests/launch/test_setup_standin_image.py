"""launch/setup_env.sh on a stand-in of the lent GPU image (issue 47): a Python that is itself a
virtualenv and holds torch 2.11.0+cu130, triton 3.6.0, numpy, setuptools and every dependency of
megaflex but the seven wheels docs/design.md's carry list names; no package index. Sourcing the
script with MEGAFLEX_OFFLINE_WHEELS=<those seven> must install megaflex into a layer that sees the
image's packages (a venv made from a venv with --system-site-packages sees the base interpreter's
instead), leave the image untouched, and pass ``pip check``. The distributions are stand-ins built
here from this environment's metadata (tests/helpers/standin_wheels.py): no network, seconds.
Also the retries of issue 45 class 7: a failed attempt leaves nothing a retry would trust."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

from standin_wheels import BUILD_TOOLS, closure, repack, standin_of, write_wheel

REPO = Path(__file__).resolve().parents[2]
# docs/design.md ("Carry list for the lent GPU image"): what the image lacks
CARRY = ("deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
NODE_OWN = {"torch", "triton", "numpy"}  # stand-ins of the image's CUDA build
TORCH, TRITON = "2.11.0+cu130", "3.6.0"


@dataclass
class Image:
    python: Path  # the image's python3: a virtualenv's
    carry: Path  # the wheels to carry
    bare: Path  # a Python without torch (the wrong environment to be in)

    @staticmethod
    def named(python: Path) -> Path:
        """How setup_env.sh names an interpreter: bin/pythonX.Y of its environment."""
        return python.parent / f"python{sys.version_info[0]}.{sys.version_info[1]}"


def _quiet_env(tmp: Path, **extra: str) -> dict[str, str]:
    """No index, no pip configuration, no MEGAFLEX_/virtualenv variables of the test's own environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGAFLEX_", "VIRTUAL_ENV", "PYTHONPATH", "PIP_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/no-index", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", MEGAFLEX_VENV=str(tmp / "layer"), **extra)  # fmt: skip
    return env


def _pip_list(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True,
                         timeout=120, env=_quiet_env(python.parent))  # fmt: skip
    return {p["name"].lower(): p["version"] for p in json.loads(out.stdout)}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    root = tmp_path_factory.mktemp("image")
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = closure(core, skip=NODE_OWN)
    assert set(CARRY) <= set(needed), sorted(set(CARRY) - set(needed))
    stock, carry = root / "stock", root / "carry"
    write_wheel(stock, "torch", TORCH, ["triton==3.6.0", "typing-extensions>=4.10.0", "setuptools"], files={
        "torch/__init__.py": "from . import version\n__version__ = version.__version__\n",
        "torch/version.py": f"__version__ = {TORCH!r}\ncuda = '13.0'\n"})  # fmt: skip
    write_wheel(stock, "triton", TRITON, packages=["triton"])
    write_wheel(stock, "numpy", "2.2.6", packages=["numpy"])
    repack(stock, "setuptools")  # builds the editable install: the carry list has no setuptools
    repack(stock, "typing-extensions", "4.12.2")  # the image's own, older than pydantic needs
    for name in needed:
        folder = carry if name in CARRY else stock
        if name == "typing-extensions" and folder is stock:
            continue
        (repack if name in BUILD_TOOLS else standin_of)(folder, name)
    python = root / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(python.parents[1])], check=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *map(str, stock.glob("*.whl"))], check=True,
                   timeout=300, env=_quiet_env(root))  # fmt: skip
    bare = root / "bare" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare.parents[1])], check=True, timeout=120)
    return Image(python, carry, bare)


def _source(tmp: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=_quiet_env(tmp, **env), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def _in_image(image: Image) -> dict[str, str]:
    """The shell of a user whose current environment is the image's venv."""
    return {"PATH": f"{image.python.parent}:{os.environ['PATH']}", "VIRTUAL_ENV": str(image.python.parents[1])}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_offline_setup_installs_into_a_layer_over_the_image_and_passes_pip_check(image: Image, tmp_path: Path) -> None:
    before = _pip_list(image.python)
    check = ('source launch/setup_env.sh && python -c "import megaflex, torch, deepspeed, sys; '
             'print(\'seen:\', sys.executable, torch.__file__, torch.__version__)" && python -m pip check')
    proc = _source(tmp_path, check, MEGAFLEX_OFFLINE_WHEELS=str(image.carry), **_in_image(image))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    chosen = [line for line in lines if line.startswith("[setup] using the environment of")]
    assert chosen == [f"[setup] using the environment of {Image.named(image.python)}: megaflex goes into {tmp_path / 'layer'}, "
                      "a layer on top of it that sees its packages and leaves them untouched"], proc.stdout  # fmt: skip
    executable, torch_file, torch_version = next(line for line in lines if line.startswith("seen: ")).split()[1:]
    assert executable == str(tmp_path / "layer" / "bin" / "python") and torch_version == TORCH
    assert torch_file.startswith(str(image.python.parents[1])), torch_file  # the image's torch, seen through the layer
    assert "No broken requirements found." in proc.stdout
    assert _pip_list(image.python) == before  # the image is untouched (its typing_extensions 4.12.2 stays)
    layer = _pip_list(tmp_path / "layer" / "bin" / "python")
    assert layer["torch"] == TORCH and Version(layer["typing_extensions"]) >= Version("4.16") and "megaflex" in layer

    again = _source(tmp_path, "source launch/setup_env.sh", **_in_image(image))  # train.sh's `source`: offline, up to date
    assert again.returncode == 0 and "[setup] environment up to date" in again.stdout, again.stdout + again.stderr
    assert f"layer {Image.named(image.python)}" in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failed_offline_attempt_leaves_nothing_and_the_recommended_python_is_honoured(image: Image,
                                                                                     tmp_path: Path) -> None:
    """Issue 45 class 7: the retry with the PYTHON= the error recommends used the venv the failed
    attempt left behind, made from the Python without torch."""
    layer = tmp_path / "layer"
    bare = {"PATH": f"{image.bare.parent}:{os.environ['PATH']}"}  # the user is in a Python without torch
    wrong = _source(tmp_path, "source launch/setup_env.sh", MEGAFLEX_OFFLINE_WHEELS=str(image.carry), **bare)
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert f"torch is not installed in this Python ({image.bare.parent}/python" in wrong.stderr and "PYTHON=" in wrong.stderr
    assert not layer.exists()  # nothing made for a retry to trust

    partial = tmp_path / "partial"  # a wheelhouse missing hjson: pip fails half-way
    shutil.copytree(image.carry, partial)
    next(partial.glob("hjson-*.whl")).unlink()
    failed = _source(tmp_path, "source launch/setup_env.sh", MEGAFLEX_OFFLINE_WHEELS=str(partial), PYTHON=str(image.python),
                     **bare)  # fmt: skip
    assert failed.returncode == 1 and "hjson" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
    assert not layer.exists()  # the half-made layer is gone

    retry = _source(tmp_path, "source launch/setup_env.sh", MEGAFLEX_OFFLINE_WHEELS=str(image.carry),
                    PYTHON=str(image.python), **bare)  # fmt: skip
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert (layer / ".megaflex-made-from").read_text().split() == ["layer", str(Image.named(image.python))]

    # A venv made from another Python than the PYTHON named now is made again, from that PYTHON (and
    # stays offline: here that Python has no torch, so nothing is made).
    other = _source(tmp_path, "source launch/setup_env.sh", PYTHON=str(image.bare), **bare)
    assert other.returncode == 2, other.stdout + other.stderr
    assert f"[setup] making {layer} again: it was made from {Image.named(image.python)}, PYTHON={image.bare}" in other.stdout
    assert not layer.exists()
