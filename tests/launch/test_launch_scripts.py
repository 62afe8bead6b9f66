"""The launch scripts' own decisions, with stub ``pip``/``python``/``deepspeed``/``srun`` binaries that
record their arguments: launch/setup_env.sh (CPU and GPU installs, a failed resolution shown and
fatal, malloc settings off GPU nodes), launch/train.sh (CUDA_VISIBLE_DEVICES respected, no silent CPU
fallback) and launch/slurm.sbatch (srun flags, NCCL variable, log path). tests/launch/test_launch_docs.py
runs the documented lines through the real launcher."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ON_GPU_NODE = any(Path("/dev").glob("nvidia[0-9]*"))


def write_stubs(bin_dir: Path, stubs: dict[str, str]) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)


def calls(log: Path, program: str) -> list[list[str]]:
    """The argument lists a stub recorded ("program arg ..." lines)."""
    if not log.exists():
        return []
    return [shlex.split(line)[1:] for line in log.read_text().splitlines() if line.startswith(program + " ")]


# --------------------------------------------------------------------------------------------
# launch/setup_env.sh
# --------------------------------------------------------------------------------------------
PIP = (
    'echo "pip $(printf "%q " "$@")" >> "$STUB_LOG"\n'
    "echo \"WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory.\"\n"
    'if [ -n "${STUB_PIP_FAIL:-}" ] && [[ " $* " == *" -e "* ]]; then\n'
    '  echo "ERROR: Cannot install megaflex because these package versions have conflicting dependencies." >&2\n'
    '  echo "ERROR: ResolutionImpossible: torch 2.13.0 depends on triton==3.7.1" >&2; exit 1\nfi\n'
)
# exit 3 for the GPU-mode check means "a CPU-only torch"; every other call succeeds
PYTHON = ('echo "python $(printf "%q " "$@")" >> "$STUB_LOG"\n[[ "$*" == *torch.version.cuda* ]] && exit "${STUB_TORCH_CPU_ONLY:-0}"\n'
          '[[ "$*" == *check_node_packages.py* ]] && exit "${STUB_NODE_CHECK:-0}"\nexit 0\n')


def run_setup(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    venv = tmp_path / "venv"
    write_stubs(venv / "bin", {"pip": PIP, "python": PYTHON})
    log = tmp_path / "stub.log"
    script = env.pop("STUB_SCRIPT", 'source launch/setup_env.sh && echo "MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_:-unset}"')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MEGAFLEX_"))}
    clean.update(MEGAFLEX_VENV=str(venv), STUB_LOG=str(log), **env)
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)
    return proc, log


def test_setup_cpu_installs_the_dev_extra_and_sets_malloc_off_gpu_nodes(tmp_path):
    proc, log = run_setup(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch_call, megaflex_call = calls(log, "pip")
    assert torch_call == ["install", "-q", "torch==2.13.0"]
    assert megaflex_call == ["install", "-q", "-e", f"{REPO}[dev]", "torch==2.13.0"]
    assert "is ignored" not in proc.stdout + proc.stderr  # the only noise filtered
    assert ("MALLOC_MMAP_MAX_=unset" if ON_GPU_NODE else "MALLOC_MMAP_MAX_=0") in proc.stdout
    again, _ = run_setup(tmp_path)  # idempotent: the stamp matches, nothing installed
    assert "environment up to date" in again.stdout and len(calls(log, "pip")) == 2


def test_setup_gpu_mode_takes_torch_from_the_named_index_and_the_gpu_extra(tmp_path):
    index = "https://download.pytorch.org/whl/cu128"
    proc, log = run_setup(tmp_path, MEGAFLEX_GPU="1", MEGAFLEX_TORCH_INDEX=index)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch_call, megaflex_call = calls(log, "pip")
    assert torch_call == ["install", "-q", "--index-url", index, "torch==2.13.0"]
    assert megaflex_call == ["install", "-q", "-e", f"{REPO}[gpu]", "torch==2.13.0"]
    assert any("torch.version.cuda" in " ".join(c) for c in calls(log, "python"))
    assert "MALLOC_MMAP_MAX_=unset" in proc.stdout  # glibc heap settings are for CPU nodes only
    again, _ = run_setup(tmp_path)  # the mode sticks to the venv: train.sh's `source` keeps the GPU install
    assert "environment up to date" in again.stdout and "MALLOC_MMAP_MAX_=unset" in again.stdout
    cpu, _ = run_setup(tmp_path, MEGAFLEX_GPU="0")  # asked for: the CPU/test install
    assert cpu.returncode == 0 and len(calls(log, "pip")) == 4 and calls(log, "pip")[-1][3] == f"{REPO}[dev]"


def test_setup_shows_a_failed_resolution_and_stops(tmp_path):
    proc, log = run_setup(tmp_path, MEGAFLEX_GPU="1", STUB_PIP_FAIL="1")
    assert proc.returncode == 1
    assert "ResolutionImpossible: torch 2.13.0 depends on triton==3.7.1" in proc.stdout + proc.stderr
    assert "pip's error is above" in proc.stderr
    assert "MALLOC_MMAP_MAX_" not in proc.stdout  # `source` failed: nothing exported, the caller decides
    assert not (tmp_path / "venv" / ".megaflex-installed").exists()


def test_setup_gpu_mode_refuses_a_cpu_only_torch(tmp_path):
    proc, log = run_setup(tmp_path, MEGAFLEX_GPU="1", STUB_TORCH_CPU_ONLY="3")
    assert proc.returncode == 1
    assert "CPU-only build" in proc.stderr and "MEGAFLEX_TORCH_INDEX" in proc.stderr
    assert len(calls(log, "pip")) == 1  # megaflex[gpu] is not installed on top of it


def test_setup_offline_installs_from_the_wheelhouse_only_and_stays_offline(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"")
    (wheels / "setuptools-80.9.0-py3-none-any.whl").write_bytes(b"")  # launch/wheelhouse.sh's: isolated build
    proc, log = run_setup(tmp_path, MEGAFLEX_OFFLINE_WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # no torch pin, no index: the node's torch and triton stay; megaflex and the wheelhouse from disk
    assert calls(log, "pip") == [["install", "-q", "--no-index", "--find-links", str(wheels), "-e", str(REPO)]]
    assert [c[0] for c in calls(log, "python") if "check_node_packages.py" in " ".join(c)] == [f"{REPO}/launch/check_node_packages.py"]
    again, _ = run_setup(tmp_path)  # train.sh's `source`: the venv stays offline, nothing installed
    assert "environment up to date" in again.stdout and len(calls(log, "pip")) == 1
    (wheels / "hjson-3.1.0-py3-none-any.whl").rename(tmp_path / "moved.whl")
    again, _ = run_setup(tmp_path)  # the wheelhouse is needed to install, not to use the install
    assert again.returncode == 0 and "environment up to date" in again.stdout, again.stderr
    (tmp_path / "moved.whl").rename(wheels / "hjson-3.1.0-py3-none-any.whl")
    (tmp_path / "venv" / ".megaflex-installed").write_text("an older install offline:" + str(wheels))
    stale, _ = run_setup(tmp_path)  # pyproject.toml changed since: reinstalled from the same wheelhouse, never an index
    assert stale.returncode == 0 and calls(log, "pip")[-1][:5] == ["install", "-q", "--no-index", "--find-links", str(wheels)]


def test_setup_offline_without_setuptools_in_the_wheelhouse_builds_with_the_nodes_own(tmp_path):
    """Issue 47: the lent image's carry list is the 7 wheels it lacks, no setuptools: megaflex's
    editable install is built with the node's setuptools (checked first), not in an isolated
    environment pip could not fill without an index."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"")
    proc, log = run_setup(tmp_path, MEGAFLEX_OFFLINE_WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls(log, "pip") == [["install", "-q", "--no-index", "--find-links", str(wheels), "--no-build-isolation",
                                  "-e", str(REPO)]]  # fmt: skip
    assert [c for c in calls(log, "python") if "check_node_packages.py" in " ".join(c)] == [
        [f"{REPO}/launch/check_node_packages.py", "--own-setuptools"]]


def test_setup_offline_refuses_a_missing_wheelhouse_or_node_torch(tmp_path):
    proc, log = run_setup(tmp_path, MEGAFLEX_OFFLINE_WHEELS=str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no wheels there; build them with launch/wheelhouse.sh" in proc.stderr
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"")
    proc, log = run_setup(tmp_path, MEGAFLEX_OFFLINE_WHEELS=str(wheels), STUB_NODE_CHECK="2")
    assert proc.returncode == 2 and not calls(log, "pip")


# The Python the caller is in (PYTHON), for a venv not made yet: STUB_PROBE is what
# check_node_packages.py --probe answers (0: a suitable torch, 1: none); `-m venv DIR` makes DIR with
# a recording python (VENV_PYTHON; and pip, unless --without-pip) whose torch is STUB_TORCH, a CUDA
# build unless STUB_CUDA=1.
BASE_PYTHON = r"""echo "base $(printf "%q " "$@")" >> "$STUB_LOG"
case "$*" in
  *"os.path.join"*) echo "$STUB_BASE/bin/python3.12" ;;
  *check_node_packages.py*) exit "${STUB_PROBE:-1}" ;;
  "-m venv"*)
    dir="${@: -1}"; mkdir -p "$dir/bin"
    cp "$STUB_BASE/bin/venv-python" "$dir/bin/python"
    [[ "$*" == *--without-pip* ]] || cp "$STUB_BASE/bin/venv-pip" "$dir/bin/pip" ;;
  "- "*) cat > "$2" ;;
esac
exit 0
"""
VENV_PYTHON = r"""echo "python $(printf "%q " "$@")" >> "$STUB_LOG"
case "$*" in
  *sysconfig*) echo "$(dirname "$0")/../lib" ;;
  *importlib.metadata*) echo "$STUB_TORCH" ;;
  *torch.version.cuda*) exit "${STUB_CUDA:-0}" ;;
esac
exit 0
"""


def run_setup_from(tmp_path: Path, probe: int, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """setup_env.sh with no venv yet, PYTHON a stub (``BASE_PYTHON``) whose torch check answers ``probe``."""
    write_stubs(tmp_path / "base" / "bin", {"python3": BASE_PYTHON, "venv-python": VENV_PYTHON, "venv-pip": PIP})
    log = tmp_path / "stub.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MEGAFLEX_", "PYTHON"))}
    clean.update(MEGAFLEX_VENV=str(tmp_path / "venv"), STUB_LOG=str(log), STUB_BASE=str(tmp_path / "base"),
                 STUB_PROBE=str(probe), STUB_TORCH="2.12.0+cu128", PYTHON=str(tmp_path / "base" / "bin" / "python3"), **env)  # fmt: skip
    proc = subprocess.run(["bash", "-c", "source launch/setup_env.sh"], cwd=REPO, env=clean, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return proc, log


def test_setup_without_torch_in_the_callers_python_makes_a_fresh_venv_as_before(tmp_path):
    proc, log = run_setup_from(tmp_path, probe=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base = tmp_path / "base" / "bin" / "python3.12"
    assert f"[setup] {base} has no torch: creating a fresh virtual environment at {tmp_path / 'venv'} with torch==2.13.0" \
        in proc.stdout.splitlines()  # fmt: skip
    assert calls(log, "base")[-1] == ["-m", "venv", str(tmp_path / "venv")]  # no --system-site-packages
    assert calls(log, "pip") == [["install", "-q", "torch==2.13.0"], ["install", "-q", "-e", f"{REPO}[dev]", "torch==2.13.0"]]
    assert (tmp_path / "venv" / ".megaflex-made-from").read_text() == f"fresh {base}\n"


@pytest.mark.parametrize("cuda", [True, False])
def test_setup_layers_over_the_callers_torch_and_keeps_it(tmp_path, cuda):
    """Issue 47: a Python that already holds a suitable torch (a venv, a conda env, a system Python)
    gets megaflex in a layer that sees its packages, never a venv that hides them; its torch is pinned
    (no dependency may pull another build), a CUDA one takes the gpu extra (its own triton)."""
    proc, log = run_setup_from(tmp_path, probe=0, STUB_CUDA="0" if cuda else "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base, venv = tmp_path / "base" / "bin" / "python3.12", tmp_path / "venv"
    assert f"[setup] using the environment of {base}: megaflex goes into {venv}, a layer on top of it that sees its " \
           "packages and leaves them untouched" in proc.stdout.splitlines()  # fmt: skip
    assert ["-m", "venv", "--without-pip", str(venv)] in calls(log, "base")  # the parent's pip installs into the layer
    assert ["-", f"{venv}/bin/../lib/_megaflex_parent_env.pth"] in calls(log, "base")  # into the layer's site-packages
    assert not calls(log, "pip")  # no torch installed
    installs = [c for c in calls(log, "python") if c[:2] == ["-m", "pip"]]
    assert installs == [["-m", "pip", "install", "-q", "-e", f"{REPO}[{'gpu' if cuda else 'dev'}]", "torch==2.12.0+cu128"]]
    assert (venv / ".megaflex-made-from").read_text() == f"layer {base}\n"
    again, _ = run_setup_from(tmp_path, probe=0)
    assert again.returncode == 0 and f"[setup] environment up to date ({venv}, layer {base})" in again.stdout


def test_setup_sourced_keeps_the_callers_shell_options_and_never_exits_it(tmp_path):
    """Issue 45 class 7: `set -euo pipefail` stayed on in the caller's (interactive) shell, and an
    error closed it."""
    check = 'before="$-$(shopt -qo pipefail && echo P)"; source launch/setup_env.sh; status=$?; ' \
            'echo "status=$status before=$before after=$-$(shopt -qo pipefail && echo P) ' \
            'left=${venv+venv}${stamp+stamp}${kind+kind}${name+name}${_megaflex_status+status}"'  # fmt: skip
    for options in ("set +euo pipefail", "set -u"):
        ok, _ = run_setup(tmp_path, STUB_SCRIPT=f"{options}; {check}")
        (line,) = [x for x in ok.stdout.splitlines() if x.startswith("status=")]
        status, before, after, left = (part.split("=", 1)[1] for part in line.split())
        assert (status, after, left) == ("0", before, ""), ok.stdout + ok.stderr  # no variable of the script left
        failed, _ = run_setup(tmp_path, MEGAFLEX_OFFLINE_WHEELS=str(tmp_path / "nowhere"), STUB_SCRIPT=f"{options}; {check}")
        (line,) = [x for x in failed.stdout.splitlines() if x.startswith("status=")]  # the shell went on
        status, before, after, left = (part.split("=", 1)[1] for part in line.split())
        assert (status, after, left) == ("2", before, ""), failed.stdout + failed.stderr
        assert "no wheels there" in failed.stderr and failed.returncode == 0


def test_node_packages_check_names_what_is_missing_or_too_old():
    check = _node_check_module()
    assert check.problems({"torch": "2.11.0+cu128", "triton": "3.6.0", "numpy": "2.2.6"}) == []
    assert check.problems({"torch": "2.13.0+cpu", "triton": None, "numpy": "1.26.4"}) == []  # CPU torch: no triton
    (old_torch,) = check.problems({"torch": "2.10.1+cu126", "triton": "3.6.0", "numpy": "2.2.6"})
    assert old_torch.startswith("torch 2.10.1+cu126 is older than the lowest supported 2.11")
    (old_triton,) = check.problems({"torch": "2.11.0", "triton": "3.5.1", "numpy": "2.2.6"})
    assert "triton 3.5.1 is older than the lowest supported 3.6" in old_triton
    (no_numpy,) = check.problems({"torch": "2.11.0", "triton": "3.6.0", "numpy": None})
    assert no_numpy.startswith("numpy is not installed in this Python") and "PYTHON=" in no_numpy
    # issue 45 class 7: a CUDA torch without triton passed; a CPU-only one may have none (above)
    (no_triton,) = check.problems({"torch": "2.11.0", "triton": None, "numpy": "2.2.6"}, torch_cuda="12.8")
    assert no_triton.startswith("torch 2.11.0 is a CUDA build (CUDA 12.8) but triton is not installed")


def test_node_packages_check_refuses_a_cuda_torch_without_triton(monkeypatch, capsys):
    check = _node_check_module()
    monkeypatch.setattr(check, "installed", {"torch": "2.11.0+cu130", "numpy": "2.2.6"}.get)
    monkeypatch.setattr(check, "cuda_of_torch", lambda: "13.0")
    assert check.main([]) == 2
    assert "[setup] error: torch 2.11.0+cu130 is a CUDA build (CUDA 13.0) but triton is not installed" in capsys.readouterr().err
    assert check.main(["--probe"]) == 2  # not used for a layer either
    monkeypatch.setattr(check, "cuda_of_torch", lambda: None)  # the same versions, a CPU-only build
    assert check.main([]) == 0 and capsys.readouterr().out == "[setup] node packages: torch 2.11.0+cu130, numpy 2.2.6\n"
    monkeypatch.setattr(check, "installed", {}.get)
    assert check.main(["--probe"]) == 1 and capsys.readouterr() == ("", "")  # no torch: silent, a fresh venv


def _node_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_node_packages", REPO / "launch" / "check_node_packages.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_pyproject_gpu_extra_leaves_triton_to_torch():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not any(req.startswith("triton") for req in extras["gpu"])
    assert "triton==3.9.0" in extras["dev"]  # the interpreter tests' pin stays in the CPU extra
    assert "deepspeed>=0.19.2" in project["dependencies"]
    # a GPU node's offline wheelhouse carries the core dependencies only: nothing training does not import
    core = {re.split(r"[<>=!~ ]", req)[0] for req in project["dependencies"]}
    assert core.isdisjoint({"datasets", "matplotlib", "tensorboard", "transformers", "triton"})
    assert {"datasets", "matplotlib", "tensorboard"} <= {re.split(r"[<>=!~ ]", r)[0] for r in extras["dev"]}


# --------------------------------------------------------------------------------------------
# launch/train.sh
# --------------------------------------------------------------------------------------------
DEEPSPEED = 'echo "deepspeed $(printf "%q " "$@")" >> "$STUB_LOG"\necho "env DS_ACCELERATOR=${DS_ACCELERATOR:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-}" >> "$STUB_LOG"\n'


def run_train_sh(tmp_path: Path, args: list[str], gpus: int | None = None, deepspeed: str = DEEPSPEED,
                 **env: str) -> tuple[subprocess.CompletedProcess, Path]:  # fmt: skip
    """launch/train.sh with a recording ``deepspeed``; ``gpus`` set: the device probe answers
    "cuda <gpus>" (this machine has none), otherwise the real probe runs."""
    bin_dir, log = tmp_path / "bin", tmp_path / "stub.log"
    stubs = {"deepspeed": deepspeed}
    if gpus is not None:
        stubs["python"] = f'[ "$1" = launch/resolve_device.py ] && {{ echo "cuda {gpus}"; exit 0; }}\nexec {sys.executable} "$@"\n'
    write_stubs(bin_dir, stubs)
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC", "HOSTFILE", "DS_ACCELERATOR", "OMP_NUM_THREADS",
                                                             "SLURM_JOB_ID", "SLURM_STEP_GPUS", "MASTER_PORT")}
    base.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", MEGAFLEX_SKIP_SETUP="1",
                STUB_LOG=str(log), PYTHONPATH=str(REPO), **env)  # fmt: skip
    proc = subprocess.run(["bash", "launch/train.sh", *args], cwd=REPO, env=base, capture_output=True, text=True, timeout=120)
    return proc, log


def test_train_sh_respects_cuda_visible_devices(tmp_path):
    proc, log = run_train_sh(tmp_path, ["--config", "configs/tiny.yaml"], gpus=3, CUDA_VISIBLE_DEVICES="2,3,5")
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log, "deepspeed")
    assert "--num_gpus" not in argv  # it would make deepspeed take GPUs 0..N-1
    assert argv[argv.index("--include") + 1] == "localhost:2,3,5"
    assert argv[argv.index("--module") + 1 :] == ["megaflex.train", "--config", "configs/tiny.yaml"]
    assert "OMP_NUM_THREADS=4" in log.read_text() and "DS_ACCELERATOR= " in log.read_text()


def test_train_sh_takes_the_first_nproc_visible_gpus(tmp_path):
    proc, log = run_train_sh(tmp_path, ["--config", "configs/tiny.yaml"], gpus=3, CUDA_VISIBLE_DEVICES="2,3,5", NPROC="2")
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log, "deepspeed")
    assert argv[argv.index("--include") + 1] == "localhost:2,3"


def test_train_sh_refuses_more_ranks_than_visible_gpus(tmp_path):
    proc, log = run_train_sh(tmp_path, ["--config", "configs/tiny.yaml"], gpus=1, CUDA_VISIBLE_DEVICES="1", NPROC="4")
    assert proc.returncode == 2 and "NPROC=4" in proc.stderr and not calls(log, "deepspeed")


def test_train_sh_without_cuda_visible_devices_counts_gpus(tmp_path):
    proc, log = run_train_sh(tmp_path, ["--config", "configs/tiny.yaml"], gpus=4)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log, "deepspeed")
    assert argv[argv.index("--num_gpus") + 1] == "4" and "--include" not in argv


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine where CUDA is unusable")
def test_train_sh_refuses_a_gpu_config_without_usable_cuda(tmp_path):
    proc, log = run_train_sh(tmp_path, ["--config", "configs/flexformer_n_41m.yaml"])
    assert proc.returncode == 2
    assert "error: train.device is cuda but CUDA is unusable" in proc.stderr and "train.device=cpu" in proc.stderr
    assert not calls(log, "deepspeed")  # no silent CPU/gloo run
    cpu, log = run_train_sh(tmp_path, ["--config", "configs/flexformer_n_41m.yaml", "train.device=cpu"], NPROC="2")
    assert cpu.returncode == 0, cpu.stderr
    (argv,) = calls(log, "deepspeed")
    assert argv[argv.index("--num_gpus") + 1] == "2" and "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1" in log.read_text()


# --------------------------------------------------------------------------------------------
# launch/slurm.sbatch
# --------------------------------------------------------------------------------------------
SRUN = 'echo "srun $(printf "%q " "$@")" >> "$STUB_LOG"\necho "env TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-} NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-unset}" >> "$STUB_LOG"\n'
SCONTROL = 'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo "node$i"; done\n'


def run_sbatch(tmp_path: Path, srun: str = SRUN) -> tuple[subprocess.CompletedProcess, Path]:
    """launch/slurm.sbatch for a 2-node job, with recording ``srun`` and ``scontrol`` stubs."""
    bin_dir, log = tmp_path / "bin", tmp_path / "stub.log"
    write_stubs(bin_dir, {"srun": srun, "scontrol": SCONTROL})
    job = f"test{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if "NCCL" not in k and k != "MASTER_PORT"}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", STUB_LOG=str(log),
               MEGAFLEX_SKIP_SETUP="1", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID=job,
               SLURM_GPUS_PER_NODE="h100:8", SLURM_CPUS_PER_TASK="48", SLURM_SUBMIT_DIR=str(REPO))  # fmt: skip
    try:
        proc = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "configs/tiny.yaml"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        (REPO / "runs" / f"hostfile-{job}").unlink(missing_ok=True)
    return proc, log


def test_sbatch_passes_cpus_per_task_and_the_current_nccl_variable(tmp_path):
    proc, log = run_sbatch(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log, "srun")
    assert "--cpus-per-task=48" in argv and "--ntasks-per-node=1" in argv
    assert argv[-4:] == ["bash", "launch/train.sh", "--config", "configs/tiny.yaml"]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_ASYNC_ERROR_HANDLING=unset" in log.read_text()


def test_sbatch_warns_the_batch_shell_only_and_leaves_the_port_to_train_sh(tmp_path):
    header = [line for line in (REPO / "launch" / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    signal_lines = [line.split()[1] for line in header if "--signal" in line]
    # B: the batch shell (srun, which forwards it to each node's train.sh), not every process of the step
    assert signal_lines == ["--signal=B:USR1@300"]
    proc, log = run_sbatch(tmp_path, SRUN + 'echo "env MASTER_PORT=${MASTER_PORT:-unset}" >> "$STUB_LOG"\n')
    assert proc.returncode == 0, proc.stderr
    assert "MASTER_PORT=unset" in log.read_text()  # not 29500 for every job: train.sh derives one per job


# --------------------------------------------------------------------------------------------
# launch/train.sh under Slurm: GPU ids, per-job port, USR1 to the whole step
# --------------------------------------------------------------------------------------------
# records its arguments and the hostfile it was given
DEEPSPEED_HOSTFILE = DEEPSPEED + 'while [ $# -gt 0 ]; do [ "$1" = --hostfile ] && sed "s/^/hostfile /" "$2" >> "$STUB_LOG"; shift; done\n'


def test_train_sh_gives_the_ranks_slurms_gpus_not_the_hostfile_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=4\nnode1 slots=4\n")
    common = dict(HOSTFILE=str(hostfile), NO_SSH="1", NODE_RANK="1", MASTER_ADDR="node0", deepspeed=DEEPSPEED_HOSTFILE)
    proc, log = run_train_sh(tmp_path, ["--config", "configs/tiny.yaml"], gpus=4, CUDA_VISIBLE_DEVICES="4,5,6,7", **common)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log, "deepspeed")
    # node 1's ranks get GPUs 4-7 (deepspeed would set CUDA_VISIBLE_DEVICES=0,1,2,3 from the slots)
    assert argv[argv.index("--include") + 1] == "node0@node1:4,5,6,7"
    assert argv[argv.index("--node_rank") + 1] == "1" and "--no_ssh" in argv
    assert [line for line in log.read_text().splitlines() if line.startswith("hostfile ")] == [
        "hostfile node0 slots=4", "hostfile node1 slots=8"]  # fmt: skip  (slot ids up to 7 exist for --include)
    assert argv[argv.index("--hostfile") + 1] != str(hostfile) and not Path(argv[argv.index("--hostfile") + 1]).exists()

    fewer, log = run_train_sh(tmp_path / "b", ["--config", "configs/tiny.yaml"], gpus=2, CUDA_VISIBLE_DEVICES="4,5", **common)
    assert fewer.returncode == 2 and "2 GPUs (4,5) but the hostfile 4 slots" in fewer.stderr and not calls(log, "deepspeed")
    slurm_only, log = run_train_sh(tmp_path / "c", ["--config", "configs/tiny.yaml"], gpus=4, SLURM_STEP_GPUS="0,1,2,3",
                                   **common)  # fmt: skip
    assert slurm_only.returncode == 0, slurm_only.stderr
    (argv,) = calls(log, "deepspeed")
    assert argv[argv.index("--include") + 1] == "node0@node1:0,1,2,3"


def test_train_sh_takes_a_port_per_slurm_job(tmp_path):
    def port(**env: str) -> str:
        proc, log = run_train_sh(tmp_path / str(len(list(tmp_path.iterdir()))), ["--config", "configs/tiny.yaml"],
                                 gpus=4, **env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (argv,) = calls(log, "deepspeed")
        return argv[argv.index("--master_port") + 1]

    assert port(SLURM_JOB_ID="1234567") == "24567" and port(SLURM_JOB_ID="1234568") == "24568"
    assert port(SLURM_JOB_ID="1234567", MASTER_PORT="31000") == "31000"
    assert port() == "29500"  # no Slurm job: the usual default


# a runner -> launch -> rank chain like deepspeed's; the rank saves nothing, it reports USR1 and exits 75
DEEPSPEED_CHAIN = (
    'grep SigIgn /proc/self/status | sed "s/^/runner /" >> "$STUB_LOG"\n'
    'bash -c \'"$STUB_PYTHON" "$STUB_RANK"; exit $?\' &\n'
    "wait $!\n"
)
RANK = """import os, signal, sys, time
log = open(os.environ["STUB_LOG"], "a")
signal.signal(signal.SIGUSR1, lambda *_: (log.write("rank got USR1\\n"), log.flush(), sys.exit(75)))
log.write("rank ready\\n"); log.flush()
time.sleep(60)
sys.exit(1)
"""


@pytest.mark.parametrize("to", ["train.sh", "the whole step"])
def test_usr1_reaches_the_ranks_and_spares_the_deepspeed_runner(tmp_path, to):
    import signal
    import time

    bin_dir, log = tmp_path / "bin", tmp_path / "stub.log"
    write_stubs(bin_dir, {"deepspeed": DEEPSPEED_CHAIN,
                          "python": f'[ "$1" = launch/resolve_device.py ] && {{ echo "cpu 0"; exit 0; }}\nexec {sys.executable} "$@"\n'})  # fmt: skip
    (tmp_path / "rank.py").write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("HOSTFILE", "NPROC", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", MEGAFLEX_SKIP_SETUP="1", STUB_LOG=str(log),
               STUB_PYTHON=sys.executable, STUB_RANK=str(tmp_path / "rank.py"))  # fmt: skip
    proc = subprocess.Popen(["bash", "launch/train.sh", "--config", "configs/tiny.yaml"], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(600):
            if log.exists() and "rank ready" in log.read_text():
                break
            time.sleep(0.1)
        # "the whole step": what Slurm's --signal without B: (or `scancel --signal`) does
        os.killpg(proc.pid, signal.SIGUSR1) if to == "the whole step" else proc.send_signal(signal.SIGUSR1)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "rank got USR1" in text, text
    assert proc.returncode == 75, text  # the rank's status, through a runner that did not die of USR1
    ignored = int(next(line.split()[-1] for line in text.splitlines() if line.startswith("runner SigIgn")), 16)
    assert ignored & (1 << (signal.SIGUSR1 - 1))


def test_ranks_not_saving_on_signals_get_usr1s_default_back():
    """The ranks inherit train.sh's ignored USR1; with checkpoint.save_on_signal=false nothing handles
    it, so it must do what it did before (end the rank), not nothing."""
    import signal

    from megaflex.training.stop_signals import SignalFlag

    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as inherited from launch/train.sh
    try:
        SignalFlag(enabled=False)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)
