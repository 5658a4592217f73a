"""Debian root filesystems for sandbox images, built without any registry: ``debootstrap --variant=minbase``.

Used by the image builders of the ``docker`` plugin (rootfs → ``docker import``) and the ``localvm`` plugin
(rootfs → ext4 → qcow2). Needs root and Debian's ``debootstrap``; Debian's package mirror must be reachable the first
time (the result is cached by the callers).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: dropped from images: package caches and lists, docs, man pages, translations (about 170 MB)
PRUNE = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
)


def run_checked(cmd: Sequence[str]) -> str:
    """Run ``cmd``; return its standard output.

    :raises RuntimeError: it exited non-zero (the command and its last 20 output lines in the message).
    """
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{tail}")
    return proc.stdout


def debootstrap(
    rootfs: Path,
    marker: Path,
    *,
    suite: str,
    mirror: str = DEFAULT_MIRROR,
    packages: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> bool:
    """Debootstrap a minimal Debian ``suite`` with ``packages`` into ``rootfs``, unless ``marker`` says a complete
    one is there already (an incomplete one is removed first); ``marker`` is written last.

    :returns: whether debootstrap ran (``False``: reused).
    :raises RuntimeError: debootstrap is missing or failed (its last output lines included).
    """
    if marker.exists():
        log(f"rootfs: cached at {rootfs}")
        return False
    tool = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not os.path.exists(tool):
        raise RuntimeError("debootstrap not found: apt-get install -y debootstrap")
    if rootfs.exists():
        shutil.rmtree(rootfs)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cmd = [tool, "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs), mirror]
    log(f"rootfs: {' '.join(cmd)}")
    run_checked(cmd)
    marker.write_text(f"{suite} {','.join(packages)}\n")
    log(f"rootfs: debootstrap took {time.monotonic() - t0:.0f} s")
    return True


def prune(rootfs: Path, rels: Sequence[str] = PRUNE) -> None:
    """Empty the directories ``rels`` (relative to ``rootfs``) of an image's root filesystem; the directories stay."""
    for rel in rels:
        p = rootfs / rel
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
