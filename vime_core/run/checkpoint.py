"""Checkpoint layout, atomic writes and retention.

``OUTPUT_DIR/checkpoints/step_{N:06d}/`` holds ``trainer/``, ``data_source.json`` and ``meta.json``; it is written
as ``step_{N:06d}.tmp/``, fsynced and renamed (:func:`commit_checkpoint`), so :func:`latest_checkpoint` never picks
a torn one, and :func:`prune_checkpoints` applies ``--keep-checkpoints`` only after a new checkpoint is complete.
The layout and the resume: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger("vime.checkpoint")

_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def new_checkpoint_dir(out_dir: Path, step: int) -> Path:
    """A fresh temporary directory for step ``step``; finish with :func:`commit_checkpoint`."""
    tmp = checkpoint_root(out_dir) / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_tree(root: Path) -> None:
    """``fsync`` every file and directory under ``root`` (and ``root`` itself), so a rename after it publishes
    data that is on disk."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_checkpoint(
    tmp: Path, meta: dict[str, Any], data_state: dict[str, Any] | None, max_checkpoints: int | None = None
) -> Path:
    """Write the data state and ``meta.json`` (last) into ``tmp``, flush everything to disk, rename ``tmp`` to its
    final name, point ``latest`` at it, then keep only the newest ``max_checkpoints`` (``None``: keep all).

    :return: the final checkpoint directory.
    """
    if data_state is not None:
        (tmp / "data_source.json").write_text(json.dumps(data_state))
    (tmp / "meta.json").write_text(json.dumps(meta))
    _fsync_tree(tmp)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    shutil.rmtree(final, ignore_errors=True)  # only a re-run with --no-resume writes a step twice
    tmp.rename(final)
    latest_tmp = final.parent / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, final.parent / "latest")
    _fsync_dir(final.parent)
    prune_checkpoints(final.parent.parent, max_checkpoints, keep=final)
    return final


def complete_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint (a ``step_N`` directory with ``meta.json``) as ``(N, path)``, oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(out_dir: Path, max_checkpoints: int | None, keep: Path | None = None) -> list[Path]:
    """Delete torn leftovers (``step_*.tmp`` directories and ``step_N`` directories without ``meta.json``) and,
    with ``max_checkpoints``, every complete checkpoint but the newest ``max_checkpoints`` (never ``keep``).

    :return: the deleted directories.
    """
    root = checkpoint_root(out_dir)
    complete = complete_checkpoints(out_dir)
    done = {p for _, p in complete}
    doomed = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p not in done and p != keep]
    if max_checkpoints is not None and len(complete) > max_checkpoints:
        doomed += [p for _, p in complete[: len(complete) - max_checkpoints] if p != keep]
    for p in doomed:
        logger.info("deleting checkpoint %s", p)
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint directory (highest step), or None; torn ones are never picked."""
    complete = complete_checkpoints(out_dir)
    return complete[-1][1] if complete else None
