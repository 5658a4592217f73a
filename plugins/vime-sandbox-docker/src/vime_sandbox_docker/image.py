"""Build the sandbox image without any registry: ``debootstrap`` a minimal Debian root filesystem, ``docker import``.

``vime-sandbox-docker build-image [--tag vime-sandbox:bookworm] [--suite bookworm] [--mirror URL]
[--packages python3,git] [--cache-dir DIR] [--force]``

The root filesystem is cached under ``--cache-dir`` (default ``~/.cache/vime/rootfs``), keyed by suite and package
list, so a second build (or a fresh dockerd) only re-imports it (seconds); an image that already exists is reused.
Needs root (debootstrap) and Debian's ``debootstrap`` package; Debian's package mirror must be reachable the first
time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from vime_core.sandbox.rootfs import DEFAULT_MIRROR, debootstrap, prune
from vime_sandbox_docker.sandbox import DEFAULT_IMAGE, docker_client

DEFAULT_PACKAGES = ("python3", "git", "ca-certificates", "procps")


def default_cache_dir() -> Path:
    return Path(os.environ.get("VIME_CACHE_DIR", Path.home() / ".cache" / "vime")) / "rootfs"


def image_exists(tag: str, base_url: str | None = None) -> bool:
    """Whether ``tag`` is present in the local docker daemon.

    :raises docker.errors.DockerException: the daemon is unreachable.
    """
    import docker

    try:
        docker_client(base_url).images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_rootfs(suite: str, mirror: str, packages: tuple[str, ...], cache_dir: Path, *, log=print) -> Path:
    """A debootstrapped root filesystem, from the cache when present.

    :returns: the directory (``cache_dir/<suite>-<hash>/rootfs``).
    :raises RuntimeError: debootstrap is missing or fails (its last output lines included).
    """
    key = hashlib.sha256(f"{suite} {mirror} {','.join(sorted(packages))}".encode()).hexdigest()[:12]
    base = cache_dir / f"{suite}-{key}"
    rootfs, done = base / "rootfs", base / "complete"
    if debootstrap(rootfs, done, suite=suite, mirror=mirror, packages=packages, log=log):
        prune(rootfs)
        (rootfs / "workspace").mkdir(exist_ok=True)
    return rootfs


def build_image(
    tag: str = DEFAULT_IMAGE,
    *,
    suite: str = "bookworm",
    mirror: str = DEFAULT_MIRROR,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    cache_dir: Path | None = None,
    force: bool = False,
    base_url: str | None = None,
    log=print,
) -> str:
    """Make sure the sandbox image ``tag`` exists: reuse it, else import the (cached) debootstrapped rootfs.

    :returns: ``tag``.
    :raises RuntimeError: debootstrap or the import failed.
    :raises docker.errors.DockerException: the daemon is unreachable.
    """
    if not force and image_exists(tag, base_url):
        log(f"image: {tag} exists, reused")
        return tag
    rootfs = build_rootfs(suite, mirror, tuple(packages), cache_dir or default_cache_dir(), log=log)
    t0 = time.monotonic()
    repo, _, version = tag.partition(":")
    changes = ['CMD ["/bin/sh"]', "ENV LANG=C.UTF-8", "WORKDIR /workspace", f"LABEL vime.sandbox.image={suite}"]
    client = docker_client(base_url, timeout_s=600)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    try:
        client.api.import_image_from_stream(tar.stdout, repository=repo, tag=version or "latest", changes=changes)
    finally:
        tar.stdout.close()
        rc = tar.wait()
    if rc != 0 or not image_exists(tag, base_url):
        raise RuntimeError(f"docker import of {rootfs} as {tag} failed (tar exit {rc})")
    log(f"image: imported {tag} in {time.monotonic() - t0:.0f} s")
    return tag


def main(argv: list[str] | None = None) -> int:
    """``vime-sandbox-docker build-image ...``; returns the exit code."""
    p = argparse.ArgumentParser(prog="vime-sandbox-docker")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build-image", help="build the sandbox image locally (debootstrap + docker import)")
    b.add_argument("--tag", default=DEFAULT_IMAGE)
    b.add_argument("--suite", default="bookworm")
    b.add_argument("--mirror", default=DEFAULT_MIRROR)
    b.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), help="comma-separated Debian packages")
    b.add_argument("--cache-dir", type=Path, default=None)
    b.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    b.add_argument("--docker-host", default=None)
    a = p.parse_args(argv)
    try:
        build_image(a.tag, suite=a.suite, mirror=a.mirror, packages=tuple(x for x in a.packages.split(",") if x),
                    cache_dir=a.cache_dir, force=a.force, base_url=a.docker_host)
    except RuntimeError as e:
        print(f"vime-sandbox-docker: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
