"""benchmarks/gpu_check/on_device.sh, the lent GPU's one call, run on CPU up to the first CUDA call
(``--dry-run``): carried wheels installed with no index into a target folder on PYTHONPATH, the node
check, gpu_check's report and every stage log in OUT, gpu_check's exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check" / "on_device.sh"


def _run(*args: str, tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "MEGAFLEX_DEVICE_SITE": str(tmp_path / "site"),
           "MEGAFLEX_GPU_CHECK_WORK": str(tmp_path / "work"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _wheel(folder: Path, name: str, version: str, module: str) -> None:
    """A tiny pure-Python wheel holding ``module``.py (what a carried wheel is, without an index)."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}.py", "CARRIED = True\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_help_and_missing_arguments(tmp_path):
    shown = _run("--help", tmp_path=tmp_path)
    assert shown.returncode == 0 and "WHEELS OUT" in shown.stdout
    assert _run(tmp_path=tmp_path).returncode == 2
    missing = _run(str(tmp_path / "no_wheels"), str(tmp_path / "out"), tmp_path=tmp_path)
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_a_broken_wheel_stops_before_gpu_check(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = _run(str(wheels), str(tmp_path / "out"), "--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "the wheels did not install" in (tmp_path / "out" / "on_device.log").read_text()
    assert not (tmp_path / "out" / "gpu_check.json").exists()


@pytest.mark.slow
def test_dry_run_installs_the_wheels_and_brings_back_the_report_and_logs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "carried_probe", "1.0", "carried_probe")
    out = tmp_path / "out"
    proc = _run(str(wheels), str(out), "--dry-run", "--stages", "environment", tmp_path=tmp_path)
    log = (out / "on_device.log").read_text()
    assert proc.returncode == 0, log
    assert (tmp_path / "site" / "carried_probe.py").is_file()  # installed into the target folder, not the env
    assert "[setup] node packages: torch" in log and "gpu_check exit status 0" in log
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["verdict"] == "passed" and report["stages"]["environment"]["stage_status"] == "ok"
    with tarfile.open(out / "stage_logs.tar.gz") as bundle:
        names = bundle.getnames()
    assert any(n.endswith("environment.log") for n in names), names
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "on_device.log", "stage_logs.tar.gz"]


# What the lent image lacks (docs/design.md, the carry list), hidden from the stand-in and carried as wheels
IMAGE_LACKS = ("deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection")


def _standin_image(tmp_path: Path) -> Path:
    """A stand-in of the lent image: a venv made from this venv's interpreter (the image's python3
    is itself a venv's) that sees this environment's packages (torch, triton, numpy, ...) through a
    .pth, less the ones the image lacks. Returns its python."""
    import importlib.metadata as md
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    hidden: set[str] = set()
    for name in IMAGE_LACKS:
        dist = md.distribution(name)
        hidden |= {Path(str(f)).parts[0] for f in dist.files or () if Path(str(f)).parts[0] != ".."}
    farm = tmp_path / "image_packages"
    farm.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth") and "megaflex" not in entry.name:
            (farm / entry.name).symlink_to(entry)
    image = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True, timeout=120)
    image_site = Path(subprocess.run([str(image / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    (image_site / "image_packages.pth").write_text(f"{farm}\n")
    return image / "bin" / "python"


@pytest.mark.slow
def test_dry_run_on_a_standin_of_the_image_installs_what_it_lacks(tmp_path):
    """The image's case: a venv interpreter with torch and triton, no deepspeed, no index. The
    carried wheels go into the target folder and gpu_check's first stage runs on them."""
    from standin_wheels import repack

    python = _standin_image(tmp_path)
    lacks = subprocess.run([str(python), "-c", "import deepspeed"], capture_output=True, text=True)
    assert lacks.returncode != 0 and "deepspeed" in lacks.stderr  # the stand-in lacks what the image lacks
    wheels = tmp_path / "wheels"
    for name in IMAGE_LACKS:
        repack(wheels, name)
    out = tmp_path / "out"
    env_python = {"PYTHON": str(python)}
    proc = subprocess.run(["bash", str(SCRIPT), str(wheels), str(out), "--dry-run", "--stages", "environment"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env_python, "MEGAFLEX_DEVICE_SITE": str(tmp_path / "site"),
                               "MEGAFLEX_GPU_CHECK_WORK": str(tmp_path / "work"),
                               "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PIP_NO_INDEX": "1"})  # fmt: skip
    log = (out / "on_device.log").read_text()
    assert proc.returncode == 0, log
    assert f"python: {python}" in log and "venv" in log and "installing 6 wheels" in log
    assert (tmp_path / "site" / "deepspeed").is_dir()  # the carried wheels, in the target folder
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["verdict"] == "passed" and report["stages"]["environment"]["versions"]["deepspeed"]
