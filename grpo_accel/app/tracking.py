"""Read metrics back from an offline wandb run, without network or a wandb server.

wandb 0.31 ships no Python reader for `offline-run-*/run-*.wandb`: the file is a LevelDB-style log
(a 7-byte `:W&B` header, then 32 KiB blocks of records framed as crc32 | length | type) whose
payloads are `wandb_internal_pb2.Record` protobufs. History rows are `Record.history` items.

    python -c "from grpo_accel.app.tracking import read_wandb_history as r; print(r('runs/demo')[-1])"
"""

from __future__ import annotations

import glob
import json
import os
import struct

_BLOCK = 32 * 1024
_HEADER = 7  # "<4sHB": ident ':W&B', magic, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    """Reassemble the framed records of a LevelDB-style log."""
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def find_wandb_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "**", "run-*.wandb"), recursive=True), key=os.path.getmtime)


def read_wandb_history(path_or_root: str) -> list[dict]:
    """History rows ({metric: value}) of a .wandb file, or of the newest one under a directory."""
    from wandb.proto import wandb_internal_pb2

    path = path_or_root
    if os.path.isdir(path_or_root):
        files = find_wandb_files(path_or_root)
        if not files:
            raise FileNotFoundError(f"no run-*.wandb file under {path_or_root}. Fix: run with --report_to wandb.")
        path = files[-1]
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file (header {data[:4]!r})")
    rows = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
