"""launch/wheelhouse.sh: usage and argument errors (issue 45 class 5, issue 47), and a whole build
without a package index (stand-in distributions of megaflex's dependencies from
tests/helpers/standin_wheels.py) from a clean git checkout, which must stay clean: the script builds
megaflex's wheel from a temporary copy. tests/launch/test_offline_install.py builds the real
wheelhouse (with the index) and installs from it."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from standin_wheels import BUILD_TOOLS, build_tool, closure, repack, standin_of, write_sdist

REPO = Path(__file__).resolve().parents[2]
FLAGS = ("--python", "--platform", "--out", "--torch", "--numpy", "--extra")


def _run(args: list[str], cwd: Path = REPO, script: Path = REPO / "launch" / "wheelhouse.sh",
         **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MEGAFLEX_"))}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env={**clean, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_help_prints_the_usage_and_a_flag_without_its_value_is_one_line():
    shown = _run(["--help"])
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert shown.stdout.startswith("Build, on a machine with a package index,") and "Options: --python X.Y" in shown.stdout
    for flag in FLAGS:
        for args in ([flag], [flag, "--out", "x"]):  # last, or followed by another flag
            proc = _run(args)
            assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout)
            assert proc.stderr == f"error: launch/wheelhouse.sh: {flag} needs a value (--help for usage)\n", (args, proc.stderr)


def _clean_checkout(dest: Path) -> Path:
    """The working tree's files (tracked and untracked, not ignored) as a fresh git checkout."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")  # fmt: skip
    for name in filter(None, files):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            (dest / os.fsdecode(name)).write_bytes(source.read_bytes())
            (dest / os.fsdecode(name)).chmod(source.stat().st_mode)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run([*git, *cmd], cwd=dest, check=True, capture_output=True)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_offline_build_from_a_copy_leaves_the_checkout_clean_and_prints_the_size(tmp_path: Path) -> None:
    checkout = _clean_checkout(tmp_path / "checkout")
    status = ["git", "status", "--porcelain", "--ignored"]
    assert subprocess.run(status, cwd=checkout, capture_output=True, text=True, check=True).stdout == ""

    # A local "index" (find-links, no index): stand-ins of megaflex's core dependencies, real build tools,
    # DeepSpeed as a source distribution (the script builds it without ops).
    index = tmp_path / "index"
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = closure(core, skip={"torch", "numpy"})
    for name in needed:
        if name == "deepspeed":
            write_sdist(index, "deepspeed", md.version("deepspeed"), [r for r in md.requires("deepspeed") if "extra" not in r])
        else:
            (build_tool if name in BUILD_TOOLS else standin_of)(index, name)
    for tool in ("setuptools", "wheel"):  # what the script adds for the editable install
        if not list(index.glob(f"{tool}-*")):
            build_tool(index, tool)

    out = tmp_path / "wheelhouse"
    proc = _run(["--out", str(out)], cwd=tmp_path, script=checkout / "launch" / "wheelhouse.sh", PIP_NO_INDEX="1",
                PIP_FIND_LINKS=str(index), PIP_CONFIG_FILE=os.devnull)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert subprocess.run(status, cwd=checkout, capture_output=True, text=True, check=True).stdout == ""  # untouched
    wheels = sorted(out.glob("*.whl"))
    names = {re.sub(r"[-_.]+", "-", p.name.split("-")[0]).lower() for p in wheels}
    assert names == set(needed) | {"setuptools", "wheel"}, names ^ (set(needed) | {"setuptools", "wheel"})
    size = sum(p.stat().st_size for p in wheels)
    assert f"[wheelhouse] {out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB ({size} bytes) in all" in proc.stdout
