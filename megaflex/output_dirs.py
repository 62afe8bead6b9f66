"""Where commands may write: never into a directory they did not create unless told to
(``--overwrite``), never into a training run's checkpoint folder (only the trainer writes there),
and with the user's umask.

Used by ``megaflex-export`` (both directions); imports only ``megaflex.checkpoint`` and ``megaflex.cli_args``.
"""

from __future__ import annotations

import os
from argparse import ArgumentTypeError
from pathlib import Path

from megaflex.checkpoint import CheckpointMeta, layout
from megaflex.cli_args import creatable_dir

# Files the trainer leaves in a run directory (megaflex.training.trainer / metrics).
_RUN_DIR_MARKERS = ("metrics.jsonl", "ds_config.json", "run.lock")


class OutputDirError(ValueError):
    """An output directory a command must not write into."""


def check_output_dir(path: str | os.PathLike, option: str, overwrite: bool) -> None:
    """``OutputDirError`` when ``claim_output_dir`` would refuse ``path``: checked before the work
    starts, so a finished export is never lost to its output path. Creates nothing."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{option} {out}: exists and is not a directory")
    if out.is_dir() and not overwrite:
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise OutputDirError(
                f"{option} {out}: the directory is not empty (holds {shown}); pass --overwrite to replace "
                "files in it, or choose a new directory"
            )
    try:
        creatable_dir(str(out))
    except ArgumentTypeError as err:
        raise OutputDirError(f"{option} {err}") from None


def claim_output_dir(path: str | os.PathLike, option: str, overwrite: bool) -> Path:
    """Create ``path`` or accept it when it is empty (or ``overwrite``); ``OutputDirError`` naming
    ``option`` and a few of the files it holds otherwise."""
    check_output_dir(path, option, overwrite)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def training_run_owner(path: str | os.PathLike) -> str | None:
    """Why ``path`` belongs to a training run (a reason to name), or None.

    A training run's checkpoint folder holds tags whose metadata the trainer wrote (it records
    the DeepSpeed config and the data-parallel layout), or sits in / is a run directory."""
    root = Path(path)
    for tag in layout.complete_tags(root):
        try:
            meta = CheckpointMeta.read(root / tag)
        except layout.CheckpointError:
            return f"it holds the checkpoint {root / tag} (unreadable metadata)"
        if meta.is_training_checkpoint:  # what megaflex-train records (an import records "source")
            return f"it holds the training checkpoint {root / tag}"
    for directory in (root, root.parent):
        for marker in _RUN_DIR_MARKERS:
            if (directory / marker).is_file():
                return f"{directory} is a training run directory (it holds {marker})"
    if layout.complete_tags(layout.run_checkpoint_dir(root)):
        return f"{root} is a training run directory (it holds {layout.CHECKPOINTS_DIR}/)"
    return None


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def snapshot(root: str | os.PathLike) -> dict[Path, tuple[int, int]]:
    """(inode, mtime) of every path under ``root``: what ``apply_umask`` must leave alone."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {p: (st.st_ino, st.st_mtime_ns) for p in root.rglob("*") if not p.is_symlink() for st in [p.stat()]}


def apply_umask(root: str | os.PathLike, before: dict[Path, tuple[int, int]]) -> None:
    """Give every file written under ``root`` since ``before = snapshot(root)`` the mode a plain
    ``open(..., "w")`` would have had (0o666 & ~umask; directories 0o777 & ~umask): safetensors
    writes through a temp file and leaves 0600. Files that were there and unchanged keep theirs."""
    mask = current_umask()
    for path in Path(root).rglob("*"):
        if path.is_symlink():
            continue
        st = path.stat()
        if before.get(path) != (st.st_ino, st.st_mtime_ns):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
