"""Read back an offline W&B run (``<dir>/wandb/offline-run-*/run-<id>.wandb``) without the network.

The .wandb file is a LevelDB-style log (W&B's "datastore"): a 7-byte header (``:W&B``, magic
0xBEE1, version 0), then 32 KiB blocks of chunks, each ``<crc32: u32><length: u16><type: u8>`` +
data (type 1: a whole record, 2/3/4: first/middle/last piece); a block tail shorter than a chunk
header is padding. Every record is a ``wandb_internal_pb2.Record`` protobuf.

W&B's writer flushes the file after ``run.finish()`` returns: right after it the file may hold its
7-byte header only (seen under load). ``finished`` waits, with a deadline, for the run's last record
(``exit``); ``records`` reads a file still being written up to its last complete record.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterator

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every protobuf ``Record`` of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pieces = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if pos + CHUNK.size + length > len(data):  # the writer has not finished this chunk
            return
        pos += CHUNK.size
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 0 and length == 0:
            continue
        pieces = chunk if kind in (FULL, FIRST) else pieces + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def finished(path: Path, timeout: float = 120.0) -> Path:
    """``path`` once its exit record (W&B's last) is on disk; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        kinds = [record.WhichOneof("record_type") for record in records(path)]
        if "exit" in kinds:
            return path
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record {timeout:.0f} s after the run finished (records: {kinds})")
        time.sleep(0.1)


def run_files(wandb_dir: Path) -> list[Path]:
    """The .wandb files of every offline run under ``wandb_dir`` (oldest first)."""
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


def history(path: Path) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of every history record of a .wandb file (later values of a key win)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            steps.setdefault(row.get("_step", record.history.step.num), {}).update(row)
    return steps


def run_config(path: Path) -> dict[str, Any]:
    """The run's config as W&B holds it (the last value of each top-level key)."""
    config: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            for item in record.run.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def run_id(path: Path) -> str:
    """The W&B run id of a .wandb file (from its run record)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    raise AssertionError(f"{path}: no run record")
