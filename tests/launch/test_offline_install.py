"""The offline install of a GPU node, end to end: launch/wheelhouse.sh builds the wheelhouse for this
Python (needs the package index: PyPI for DeepSpeed's sdist and hjson), a fresh venv gets only what a
node brings (torch, triton 3.6.0 -- the lowest supported -- and numpy, from the local wheel cache),
then launch/setup_env.sh with MEGAFLEX_OFFLINE_WHEELS installs megaflex with every index and pip
configuration file switched off, and ``python -m benchmarks.gpu_check --dry-run`` runs in it.

The wheelhouse is cached (MEGAFLEX_WHEELHOUSE_CACHE, default ~/.cache/megaflex/wheelhouse) under a
key of megaflex's dependencies and the script, so it is rebuilt only when either changes. A wheelhouse
that cannot be built fails the test: it never skips (CI has the index)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROVIDED = ("torch", "triton", "numpy", "nvidia")  # the node's own: never in the wheelhouse
MAX_MB = 30


def _quiet_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGAFLEX_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(extra)
    return env


def cached_wheelhouse() -> Path:
    """This Python's wheelhouse, built by launch/wheelhouse.sh unless the cache holds it."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    key = hashlib.sha256(json.dumps([deps, (REPO / "launch" / "wheelhouse.sh").read_text(), sys.version_info[:2]])
                         .encode()).hexdigest()[:16]  # fmt: skip
    root = Path(os.environ.get("MEGAFLEX_WHEELHOUSE_CACHE") or Path.home() / ".cache" / "megaflex" / "wheelhouse")
    done = root / key
    if (done / ".complete").is_file():
        return done
    building = root / f"{key}.building{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    proc = subprocess.run(["bash", "launch/wheelhouse.sh", "--out", str(building)], cwd=REPO, capture_output=True,
                          text=True, timeout=1200, env=_quiet_env(PYTHON=sys.executable))  # fmt: skip
    assert proc.returncode == 0, f"launch/wheelhouse.sh failed (it needs the package index):\n{proc.stdout}\n{proc.stderr}"
    (building / ".complete").write_text(proc.stdout)
    try:
        building.rename(done)
    except OSError:  # another run finished first: use its copy
        shutil.rmtree(building, ignore_errors=True)
    return done


def _versions(python: Path, names: tuple[str, ...]) -> dict[str, str]:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_offline_install_onto_a_preinstalled_torch_runs_the_gpu_check(tmp_path):
    import torch

    wheels = cached_wheelhouse()
    names = sorted(p.name for p in wheels.glob("*.whl"))
    size_mb = sum(p.stat().st_size for p in wheels.glob("*.whl")) / 2**20
    assert size_mb <= MAX_MB, f"wheelhouse {size_mb:.1f} MB > {MAX_MB} MB: {names}"
    assert not [n for n in names if n.lower().startswith(PROVIDED)], names
    assert any(n.startswith("deepspeed-") and n.endswith("-py3-none-any.whl") for n in names), names
    assert any(n.startswith("pydantic_core-") for n in names) and any(n.startswith("hjson-") for n in names), names

    # The node: a Python holding torch, triton and numpy only (the local wheel cache serves them).
    node = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(node)], check=True, timeout=300)
    torch_version = torch.__version__.split("+")[0]
    # numpy < 2.3: triton 3.6.0's interpreter (the CPU dry run runs the kernels under TRITON_INTERPRET)
    # fails on numpy 2.3+ ("only 0-dimensional arrays can be converted to Python scalars"; 2.2.6 works);
    # on a GPU the kernels are compiled and the interpreter is never used.
    subprocess.run([str(node / "bin" / "pip"), "install", "-q", f"torch=={torch_version}", "triton==3.6.0", "numpy<2.3"],
                   check=True, timeout=900, env=_quiet_env())  # fmt: skip
    before = _versions(node / "bin" / "python", ("torch", "triton", "numpy"))

    # No index, no find-links but the wheelhouse, no pip configuration file: what a cut-off node has.
    offline = _quiet_env(MEGAFLEX_VENV=str(node), MEGAFLEX_OFFLINE_WHEELS=str(wheels), PIP_CONFIG_FILE=os.devnull,
                         PIP_INDEX_URL="http://127.0.0.1:9/no-index", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="")  # fmt: skip
    setup = subprocess.run(["bash", "launch/setup_env.sh"], cwd=REPO, env=offline, capture_output=True, text=True,
                           timeout=900)  # fmt: skip
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert _versions(node / "bin" / "python", ("torch", "triton", "numpy")) == before  # left untouched
    again = subprocess.run(["bash", "-c", "source launch/setup_env.sh"], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env={**offline, "MEGAFLEX_OFFLINE_WHEELS": ""})  # fmt: skip
    assert again.returncode == 0 and "environment up to date" in again.stdout, again.stdout + again.stderr

    out = tmp_path / "gpu_check"
    check = subprocess.run([str(node / "bin" / "python"), "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=1500,
                           env=_quiet_env(OMP_NUM_THREADS="1"))  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    assert check.returncode == 0, {name: s.get("log_tail", s.get("error")) for name, s in report["stages"].items()}
    env_stage = report["stages"]["environment"]
    assert env_stage["pip_check"]["passed"], env_stage["pip_check"]  # every dependency resolved from the wheelhouse
    assert env_stage["versions"]["torch"] == before["torch"] and env_stage["versions"]["triton"] == "3.6.0"
    assert report["stages"]["trainer_247m"]["tokens_per_s"] > 0
    assert all(stage["stage_status"] == "ok" for stage in report["stages"].values()), report["stages"]
