"""Every launch line of README.md and docs/*.md runs through the real launcher (deepspeed, launch/
train.sh, launch/slurm.sbatch with stub ``srun``/``scontrol``), adapted to 2 CPU ranks, the tiny
test config and 2 steps: documentation and launcher cannot drift apart."""

from __future__ import annotations

import re
import shlex
import sys
import subprocess
from pathlib import Path

import pytest

from megaflex.training.metrics import read_metrics
from training_harness import REPO, launcher_env, write_config

pytestmark = pytest.mark.slow

LAUNCHERS = ("deepspeed", "bash launch/train.sh", "sbatch")
ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def launch_lines() -> list[tuple[str, str]]:
    """(file, command) of every launch command: whole lines in fenced code, `spans` elsewhere."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        fenced = False
        for line in doc.read_text().replace("\\\n", " ").splitlines():  # continued lines joined
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            texts = [line.split(" #", 1)[0]] if fenced else re.findall(r"`([^`]+)`", line)
            for text in texts:
                if _launcher(text):
                    found.append((doc.name, text.strip()))
    return found


def _launcher(command: str) -> str | None:
    """The launcher a command runs, when it is a command with arguments (not a bare name)."""
    words = [w for w in command.split() if not ENV_RE.match(w)]
    text = " ".join(words)
    return next((k for k in LAUNCHERS if text.startswith(k + " ") and len(words) > len(k.split()) + 1), None)


def _distinct(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Lines that differ once adapted (e.g. NPROC=8 and NPROC=2 run the same command)."""
    seen, out = set(), []
    for doc, command in lines:
        argv, env = adapt(command, Path("cfg.yaml"), Path("tmp"))
        key = (tuple(argv), tuple(sorted((k, v) for k, v in env.items() if k in ("HOSTFILE", "SLURM_JOB_NUM_NODES"))))
        if key not in seen:
            seen.add(key)
            out.append((doc, command))
    return out
STUBS = {
    # Slurm: every "node" is a task on this machine with its own SLURM_NODEID.
    "srun": 'echo "srun $*" >> "$STUB_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\npids=()\n'
            'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done\n'
            'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n',
    "scontrol": 'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo "node$i"; done\n',
    # The launcher's ssh reachability check of a one-host hostfile: run the command here.
    "ssh": 'while [[ "$1" == -* ]]; do shift 2; done\nshift\nexec bash -c "$*"\n',
}


PARALLEL_SIZES = ("tensor", "context", "pipeline")
DROPPED = ("train.micro_batch_size=", "train.global_batch_size=")  # the tiny config's batch


def _two_rank_layout(words: list[str]) -> dict[str, int]:
    """The documented layout cut to 2 ranks: the axis the line is about at 2 (TP when it turns on
    sequence parallelism, else PP, CP, TP in that order), the others 1."""
    sizes = {axis: 1 for axis in PARALLEL_SIZES}
    for word in words:
        for axis in PARALLEL_SIZES:
            if word.startswith(f"parallel.{axis}_parallel_size="):
                sizes[axis] = int(word.split("=", 1)[1])
    keep = "tensor" if "parallel.sequence_parallel=true" in words else next(
        (axis for axis in ("pipeline", "context", "tensor") if sizes[axis] > 1), None)
    return {axis: 2 if axis == keep else 1 for axis in PARALLEL_SIZES}


def adapt(command: str, cfg: Path, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The documented command on 2 CPU ranks with the tiny config: (argv, extra environment)."""
    words = shlex.split(command)
    env: dict[str, str] = {}
    while ENV_RE.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if "NPROC" in env or "LOCAL_SIZE" in env:
        env.update({k: "2" for k in ("NPROC", "LOCAL_SIZE") if k in env})
    if "HOSTFILE" in env:
        env["HOSTFILE"] = str(tmp_path / "hostfile")  # one host: the launcher starts both ranks here
    argv = []
    layout = _two_rank_layout(words)
    for i, word in enumerate(words):
        if word == "..." or word.startswith(DROPPED) or word.startswith(tuple(f"parallel.{a}_parallel_size=" for a in PARALLEL_SIZES)):
            continue
        if i > 0 and words[i - 1] == "--num_gpus":
            word = "2"
        if i > 0 and words[i - 1] == "--hostfile":
            word = str(tmp_path / "hostfile")
        if word.startswith("configs/") and not word.startswith("configs/zero/"):
            word = str(cfg)  # the model config: the tiny test model
        argv.append(word)
    if cfg.as_posix() not in argv:
        argv.insert(argv.index("--config") + 1, str(cfg))
    argv += [f"parallel.{axis}_parallel_size={size}" for axis, size in layout.items() if size > 1]
    if argv[0] == "sbatch":  # run the batch script as Slurm would, on 2 "nodes" of 1 rank
        argv = ["bash", *[w for w in argv[1:] if not w.startswith("--nodes")]]
        env.update(SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_GPUS_PER_NODE="1",
                   SLURM_JOB_ID=f"test{tmp_path.name}", SLURM_SUBMIT_DIR=str(REPO), MASTER_ADDR="127.0.0.1")
    return argv, env


ALL_LINES = launch_lines()
LINES = _distinct(ALL_LINES)


@pytest.mark.parametrize("doc,command", LINES, ids=[f"{d}:{c[:60]}" for d, c in LINES])
def test_documented_launch_line_runs(tmp_path: Path, doc: str, command: str) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    argv, extra = adapt(command, cfg, tmp_path)
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = launcher_env(2)
    env.update(extra, PATH=f"{bin_dir}:{env['PATH']}", STUB_LOG=str(tmp_path / "stub.log"))
    run = tmp_path / "run"
    overrides = [f"logging.run_dir={run}", "train.train_iters=2", "schedule.warmup_iters=0", "checkpoint.save_interval=0", "checkpoint.save_at_end=false"]
    try:
        out = subprocess.run(argv + overrides, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if "SLURM_JOB_ID" in extra:
            (REPO / "runs" / f"hostfile-{extra['SLURM_JOB_ID']}").unlink(missing_ok=True)
    log = out.stdout[-4000:] + out.stderr[-4000:]
    assert out.returncode == 0, f"{doc}: {command}\n-> {argv}\n{log}"
    tp, cp, pp = (_two_rank_layout(argv)[axis] for axis in ("tensor", "context", "pipeline"))
    assert f"world 2 = TP {tp} x CP {cp} x PP {pp} x DP {2 // (tp * cp * pp)}" in out.stdout, log
    assert sorted(read_metrics(run / "metrics.jsonl")) == [1, 2]
    if argv[1:2] == ["launch/slurm.sbatch"]:
        stub_log = (tmp_path / "stub.log").read_text()
        assert "--ntasks-per-node=1" in stub_log and "bash launch/train.sh" in stub_log
        assert "--node_rank=0" in out.stdout + out.stderr and "--node_rank=1" in out.stdout + out.stderr


def test_every_kind_of_launch_line_is_found() -> None:
    assert {_launcher(c) for _, c in ALL_LINES} == set(LAUNCHERS), ALL_LINES
    assert {doc for doc, _ in ALL_LINES} >= {"README.md", "training.md"}


MODULE_RE = re.compile(r"python -m ([A-Za-z_][\w.]*)((?:[ \t]+[^ \t\n`|#;]+)*)")  # to the line's end, a comment or a pipe


def module_lines() -> dict[str, set[str]]:
    """``python -m MODULE`` commands of README.md and docs/*.md (continued lines joined): module ->
    the ``--flags`` the docs give it."""
    found: dict[str, set[str]] = {}
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "results" / "README.md"]:
        for module, rest in MODULE_RE.findall(doc.read_text().replace("\\\n", " ")):
            flags = {w.split("=")[0] for w in rest.split() if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)}
            found.setdefault(module, set()).update(flags)
    return found


MODULES = module_lines()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "pytest"))
def test_documented_python_modules_exist_and_take_their_flags(module: str) -> None:
    """Every module the docs run exists and its ``--help`` lists every flag the docs pass it."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"python -m {module} --help\n{out.stderr[-3000:]}"
    missing = sorted(f for f in MODULES[module] if f not in out.stdout)
    assert not missing, f"python -m {module}: the docs pass {missing}, its --help does not list them"
