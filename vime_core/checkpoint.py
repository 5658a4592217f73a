"""Checkpoint layout and atomic writes.

``OUTPUT_DIR/checkpoints/step_{N:06d}/`` holds ``trainer/`` (backend state), ``data_source.json`` (the buffer)
and ``meta.json`` (``{"step": N, "weight_version": V}``, N = completed steps). ``checkpoints/latest`` names the
newest complete one; it is replaced only after the checkpoint directory is complete, so a crash mid-save leaves
the previous checkpoint as ``latest``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def new_checkpoint_dir(out_dir: Path, step: int) -> Path:
    """A fresh temporary directory for step ``step``; finish with :func:`commit_checkpoint`."""
    tmp = checkpoint_root(out_dir) / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(tmp: Path, meta: dict[str, Any], data_state: dict[str, Any] | None) -> Path:
    """Write metadata, rename ``tmp`` into place and point ``latest`` at it."""
    if data_state is not None:
        (tmp / "data_source.json").write_text(json.dumps(data_state))
    (tmp / "meta.json").write_text(json.dumps(meta))
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    latest_tmp = final.parent / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, final.parent / "latest")
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    latest = checkpoint_root(out_dir) / "latest"
    if not latest.exists():
        return None
    path = latest.parent / latest.read_text().strip()
    return path if (path / "meta.json").exists() else None
