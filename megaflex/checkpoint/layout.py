"""The on-disk layout of megaflex checkpoints: the only module that knows file and folder names.

The rest of ``megaflex.checkpoint`` (manager, weights, reshard) and every caller outside it
(training, evaluation, export) read and write checkpoints through these functions; this module
imports nothing from megaflex but ``hashing``::

    <run_dir>/checkpoints/         the default checkpoint.dir (``run_checkpoint_dir``)
    <run_dir>/merged/              LoRA-merged weights of a distillation run (``merged_checkpoint_dir``)
    <checkpoint.dir>/
        latest                     text file naming the newest complete tag (replaced by rename)
        step_00000010/             one complete checkpoint ("tag")
            mp_rank_00_model_states.pt, *zero_pp_rank_*_optim_states.pt, ...   (DeepSpeed engine)
            layer_03-model_01-model_states.pt   (pipeline parallelism: layer 3's weights on TP rank 1;
                                   there mp_rank_XX counts pipeline stage x TP: XX = stage * tp + tp_rank)
            megaflex.json          metadata: iteration, sizes, shapes, config, ... and "files":
                                   {relative path: {"size": bytes, "sha256": hex}} of every other file
            rng/rank_00000.pt      per-rank RNG states
        .tmp-step_00000015/        a save in progress (or interrupted: ignored, removed by the next save)
        universal/step_00000010/   DeepSpeed "universal" copy of a ZeRO 1-3 tag (whole fp32 weights and
                                   Adam moments per parameter, under zero/), made on the first resume
                                   with another DP x CP count; removed with its tag

A tag is *complete* when its metadata file exists (it is written last, then the folder is
renamed into place). ``verify_files`` re-checks sizes and SHA-256 sums against the metadata so a
truncated or damaged shard is named before DeepSpeed reads it. The metadata is an open dict:
callers may add keys (e.g. a tokenizer record); only "files" is owned here.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from megaflex.hashing import sha256_file

TAG_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
META_FILE = "megaflex.json"
LATEST_FILE = "latest"
FILES_KEY = "files"  # the per-file checksum table inside the metadata
RNG_DIR = "rng"
UNIVERSAL_DIR = "universal"
MODEL_STATES = "mp_rank_{:02d}_model_states.pt"
PIPELINE_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")  # DeepSpeed's pipeline engine
CHECKPOINTS_DIR = "checkpoints"  # <run_dir>/checkpoints: the default checkpoint.dir
MERGED_DIR = "merged"  # <run_dir>/merged: the LoRA-merged final weights of megaflex-distill


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with this run (missing, incomplete, corrupt or mismatched)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is unreadable or differs from its recorded size/checksum."""


# ------------------------------------------------------------------------------- names
def run_checkpoint_dir(run_dir: str | Path) -> Path:
    """The checkpoint folder of a run directory (``checkpoint.dir`` when that is not set)."""
    return Path(run_dir) / CHECKPOINTS_DIR


def merged_checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a distillation run writes its LoRA-merged weights (``megaflex.checkpoint.save_weights_only``)."""
    return Path(run_dir) / MERGED_DIR


def tag_for(iteration: int) -> str:
    return f"step_{iteration:08d}"


def tag_iteration(tag: str) -> int | None:
    match = TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def tmp_dir(ckpt_dir: str | Path, tag: str) -> Path:
    return Path(ckpt_dir) / (TMP_PREFIX + tag)


def stale_tmp_dirs(ckpt_dir: str | Path) -> list[Path]:
    return sorted(Path(ckpt_dir).glob(TMP_PREFIX + "*"))


def model_states_file(tag_dir: str | Path, tp_rank: int) -> Path:
    return Path(tag_dir) / MODEL_STATES.format(tp_rank)


def zero_optim_files(tag_dir: str | Path, tp_rank: int) -> list[Path]:
    """DeepSpeed's ZeRO optimizer shards of one TP rank (empty for ZeRO 0)."""
    return sorted(Path(tag_dir).glob(f"*zero_pp_rank_*_mp_rank_{tp_rank:02d}_optim_states.pt"))


def tp_rank_files(tag_dir: str | Path, tp_rank: int) -> list[Path]:
    """Every DeepSpeed state file (model and optimizer) of one TP rank."""
    return sorted(Path(tag_dir).glob(f"*mp_rank_{tp_rank:02d}_*_states.pt"))


def pipeline_layer_files(tag_dir: str | Path, tp_rank: int) -> dict[int, Path]:
    """{layer index: file} of the per-layer weights DeepSpeed's pipeline engine wrote for ``tp_rank``."""
    out = {}
    for f in Path(tag_dir).iterdir():
        match = PIPELINE_LAYER_RE.match(f.name)
        if match and int(match.group(2)) == tp_rank:
            out[int(match.group(1))] = f
    return dict(sorted(out.items()))


def rng_file(tag_dir: str | Path, rank: int) -> Path:
    return Path(tag_dir) / RNG_DIR / f"rank_{rank:05d}.pt"


def universal_dir(ckpt_dir: str | Path, tag: str) -> Path:
    """Where the universal copy of ``tag`` lives (``convert_to_universal``)."""
    return Path(ckpt_dir) / UNIVERSAL_DIR / tag


# ------------------------------------------------------------------------------- tags and `latest`
def complete_tags(ckpt_dir: str | Path) -> list[str]:
    """Committed tags (those with their metadata file), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and TAG_RE.match(p.name) and (p / META_FILE).is_file()]
    return sorted(tags, key=tag_iteration)


def read_latest(ckpt_dir: str | Path) -> str | None:
    """The tag ``latest`` names (None without the file); ``CorruptCheckpointError`` when it is not
    a UTF-8 text line."""
    pointer = Path(ckpt_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    try:
        return pointer.read_bytes().decode("utf-8").strip() or None
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"corrupt checkpoint file {pointer}: not a tag name (invalid UTF-8 byte "
                                     f"{e.object[e.start]:#04x} at byte {e.start})") from None


def write_latest(ckpt_dir: str | Path, tag: str) -> None:
    write_atomic(Path(ckpt_dir) / LATEST_FILE, tag + "\n")
    fsync_path(Path(ckpt_dir))


def auto_candidates(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoints ``resume=auto`` may use, best first: the one ``latest`` names, then every other
    complete tag newest first (the fall-backs when a newer one turns out to be corrupt)."""
    root = Path(ckpt_dir)
    tags = complete_tags(root)[::-1]
    try:
        pointed = read_latest(root)
    except CorruptCheckpointError:
        pointed = None  # a damaged pointer: the complete tags, newest first, are the candidates
    if pointed in tags:
        tags.remove(pointed)
        tags.insert(0, pointed)
    return [root / t for t in tags]


def resolve_tag(ckpt_dir: str | Path, resume: str) -> Path:
    """An explicit checkpoint (a folder path, or a tag inside ``ckpt_dir``) that must be complete."""
    root, path = Path(ckpt_dir), Path(resume)
    if not path.is_dir():
        path = root / resume
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"checkpoint.resume: {resume!r} is not a complete checkpoint (no {META_FILE} in {path}); "
            f"complete ones in {root}: {complete_tags(root) or 'none'}"
        )
    return path


# ------------------------------------------------------------------------------- metadata
def read_meta(tag_dir: str | Path) -> dict[str, Any]:
    """The metadata of a checkpoint; unreadable JSON is named as a corrupt file."""
    path = Path(tag_dir) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {tag_dir}: {path} not found (not a complete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"corrupt checkpoint file {path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"corrupt checkpoint file {path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def write_meta(tag_dir: str | Path, meta: dict[str, Any], files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write ``meta`` plus ``files`` (default: ``file_manifest(tag_dir)``; call it after every
    other file is written). Returns the dict as written."""
    full = dict(meta, **{FILES_KEY: file_manifest(tag_dir) if files is None else files})
    write_atomic(Path(tag_dir) / META_FILE, json.dumps(full, indent=1))
    return full


def data_file_names(tag_dir: str | Path) -> list[str]:
    """Relative paths of the checkpoint's files other than the metadata, sorted."""
    root = Path(tag_dir)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != META_FILE and ".tmp" not in p.name)


def file_manifest(tag_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of ``names`` (default: every data file), hashed on a
    few threads (hashlib releases the GIL, so shards hash in parallel)."""
    root = Path(tag_dir)
    names = data_file_names(root) if names is None else list(names)
    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
        sums = list(pool.map(lambda n: sha256_file(root / n), names))
    return {n: {"size": (root / n).stat().st_size, "sha256": s} for n, s in zip(names, sums)}


def verify_files(tag_dir: str | Path, meta: dict[str, Any], names: Iterable[str] | None = None) -> list[str]:
    """Problems (one line each, naming the file) of the recorded files ``names`` (default: all).
    A checkpoint written before checksums were recorded has nothing to check: []."""
    root, table = Path(tag_dir), meta.get(FILES_KEY) or {}
    problems = []
    for name in sorted(table if names is None else names):
        want, path = table[name], root / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, expected {want['size']} (truncated or overwritten)")
        elif sha256_file(path) != want["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the one recorded at save time")
    return problems


def verify_checkpoint(tag_dir: str | Path) -> dict[str, Any]:
    """Read the metadata and check every recorded file; raise ``CorruptCheckpointError`` naming
    the first bad file. Returns the metadata."""
    meta = read_meta(tag_dir)
    problems = verify_files(tag_dir, meta)
    if problems:
        raise CorruptCheckpointError(f"corrupt checkpoint file {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return meta


# ------------------------------------------------------------------------------- universal copies
def convert_to_universal(tag_dir: str | Path, out_dir: str | Path) -> Path:
    """Write DeepSpeed's universal form of the ZeRO 1-3 checkpoint ``tag_dir`` to ``out_dir``.

    ZeRO shards are slices of flat buffers cut for one DP x CP count; the universal form holds
    each parameter's whole fp32 weight and optimizer moments (``out_dir/zero/<name>/``), which
    DeepSpeed's ``checkpoint.load_universal`` repartitions over any count. Done once (in a temp
    folder renamed into place, so an interrupted conversion is redone); returns ``out_dir``."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = Path(out_dir)
    if out.is_dir():
        return out
    tmp = out.with_name(TMP_PREFIX + out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        input_folder=str(tag_dir), output_folder=str(tmp), num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True,
        inject_missing_state=True,  # megaflex saves no Megatron-style TP slicing info: TP 1 only
    )
    log = io.StringIO()  # its progress bars and prints; shown only when it fails
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal(args)
    except BaseException as e:
        raise RuntimeError(f"{type(e).__name__}: {e}; DeepSpeed's output:\n{log.getvalue()[-3000:]}") from e
    (tmp.parent / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer; megaflex names the tag
    fsync_tree(tmp)
    tmp.rename(out)
    return out


def prune_universal(ckpt_dir: str | Path) -> None:
    """Remove universal copies (and interrupted conversions) whose tag is gone."""
    root = Path(ckpt_dir) / UNIVERSAL_DIR
    if not root.is_dir():
        return
    keep = set(complete_tags(ckpt_dir))
    for path in root.iterdir():
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------- file system
def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """Flush one file or directory (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file of a checkpoint so a power loss after the commit cannot lose them."""
    for path in [*root.rglob("*"), root]:
        fsync_path(path)


def check_writable(ckpt_dir: str | Path) -> int:
    """Create ``ckpt_dir`` and prove a file can be written there; returns its free bytes.

    Raises ``CheckpointError`` naming the directory (and the OS reason) when it cannot."""
    root = Path(ckpt_dir)
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {root} is not writable: {e.strerror or e}; "
                              "set checkpoint.dir to a writable directory") from None
    return shutil.disk_usage(root).free


def directory_size(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def is_out_of_space(error: BaseException, directory: str | Path) -> bool:
    """Whether a failed write was (most likely) a full disk. torch.save reports ENOSPC as a bare
    ``RuntimeError: ... iostream error``, so a failure with (almost) no free space counts too."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False
