"""Read an offline W&B run back without a server: the records of ``wandb/offline-run-*/run-<id>.wandb``.

The file is a LevelDB-style log (wandb-core's ``store`` package): a 7-byte header (``:W&B``, magic ``0xBEE1``,
version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32C, little-endian length, chunk type:
1 full, 2 first, 3 middle, 4 last); the assembled payloads are W&B's own protobuf ``Record`` messages
(``wandb.proto.wandb_internal_pb2``). Used by tests to check what a run logged (wandb has no public reader of
offline files).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` of ``path`` (a ``run-<id>.wandb`` file), in order.

    :raises ValueError: if ``path`` is not a W&B run file.
    """
    from wandb.proto import wandb_internal_pb2  # the wandb extra; only the tests that need it import this module

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, records, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the rest of a block too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:  # zeros past the last chunk
            break
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def history(path: Path) -> list[dict[str, Any]]:
    """The history rows of a run file (one per ``wandb.log`` call), W&B's own ``_step``/``_runtime``/``_timestamp``
    left out."""
    rows = []
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_info(path: Path) -> tuple[Any, dict[str, Any]]:
    """The run record (``project``, ``run_group``, ``display_name``, ...) and its config (``_wandb`` left out)."""
    run = next(r.run for r in read_records(path) if r.WhichOneof("record_type") == "run")
    return run, {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}


def wait_finished(path: Path, timeout_s: float = 60.0) -> None:
    """Wait until the file holds the run's exit record (wandb-core writes it from its own process shortly after
    ``finish()`` returns).

    :raises TimeoutError: naming the file.
    """
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in read_records(path)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no exit record after {timeout_s:.0f} s")
        time.sleep(0.2)


def offline_run_file(directory: Path) -> Path:
    """The single ``wandb/offline-run-*/run-*.wandb`` under ``directory``.

    :raises FileNotFoundError: if there is not exactly one.
    """
    found = sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))
    if len(found) != 1:
        raise FileNotFoundError(f"{directory}/wandb: expected one offline run file, found {[str(f) for f in found]}")
    return found[0]
