"""Unpacking a tar archive that came out of a sandbox (untrusted) onto the host."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path


def extract_tar_safely(blob: bytes, dest: Path) -> None:
    """Extract a tar archive into ``dest`` keeping only regular files and directories, none outside ``dest``.

    :raises OSError: a member would land outside ``dest``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:*") as tar:
        for m in tar.getmembers():
            name = m.name.lstrip("/")
            if name in ("", "."):
                continue
            out = (root / name).resolve()
            if root != out and root not in out.parents:
                raise OSError(1, "archive member outside the destination", m.name)
            if m.isdir():
                out.mkdir(parents=True, exist_ok=True)
            elif m.isfile():
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                with open(out, "wb") as f:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                os.chmod(out, m.mode & 0o777)
