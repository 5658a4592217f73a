"""Build the base VM image: ``debootstrap`` (kernel, openssh-server, python3, git) → ext4 → qcow2, no registry.

``vime-sandbox-localvm build-image [--out DIR] [--suite bookworm] [--mirror URL] [--size-mb 2048] [--force]``

Writes to ``DIR`` (default ``~/.cache/vime/localvm/<suite>``): ``base.qcow2`` (the root filesystem, booted
read-only through a per-sandbox copy-on-write overlay), ``vmlinuz`` and ``initrd.img`` (direct kernel boot, a small
initramfs with the virtio modules), ``id_ed25519``/``id_ed25519.pub`` (the key vime logs in with as root) and
``manifest.json``. The guest's PID 1 is ``/usr/local/sbin/vime-init`` (no systemd): it mounts ``/proc``, ``/sys``,
``/dev``, a tmpfs ``/tmp`` and ``/workspace`` (``vime.disk`` bytes each), with ``vime.agents=1`` the host's prepared
agent CLIs (9p tag :data:`AGENTS_TAG`, read-only) at ``/opt/vime/agents``, configures QEMU's user network, puts sshd
in a pids-limited cgroup (``vime.pids``), starts sshd and reaps orphans until ``vime.wall`` seconds have passed,
then powers the VM off. Needs root, ``debootstrap``, ``e2fsprogs`` (``mkfs.ext4 -d``) and ``qemu-utils``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from vime_core.sandbox.pid1 import REAPER_SOURCE
from vime_core.sandbox.rootfs import DEFAULT_MIRROR, debootstrap, prune, run_checked

#: Version of what the build writes into the root filesystem (vime-init, the agents mount point). An image with an
#: older ``format`` in its ``manifest.json`` is rebuilt by :func:`build_vm_image` (the debootstrapped root filesystem
#: is reused: only the guest configuration, ext4 and qcow2 steps run again).
#: 2: ``/opt/vime/agents`` and vime-init mounting the ``vimeagents`` 9p share there (``vime.agents=1``).
IMAGE_FORMAT = 2
#: 9p mount tag of the read-only share of the host's prepared agent CLIs (``vime agent prepare``).
AGENTS_TAG = "vimeagents"
PACKAGES = ("linux-image-amd64", "openssh-server", "python3", "git", "iproute2", "procps", "ca-certificates")

VIME_INIT = r"""#!/bin/sh
# vime-init: PID 1 of a vime sandbox VM (see vime_sandbox_localvm.image).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
DISK=1073741824; WALL=0; PIDS=0; NET=0; AGENTS=0
for kv in $(cat /proc/cmdline); do
  case "$kv" in
    vime.agents=*) AGENTS=${kv#vime.agents=} ;;
    vime.disk=*) DISK=${kv#vime.disk=} ;;
    vime.wall=*) WALL=${kv#vime.wall=} ;;
    vime.pids=*) PIDS=${kv#vime.pids=} ;;
    vime.net=*) NET=${kv#vime.net=} ;;
  esac
done
mount -t tmpfs -o mode=1777,size=$DISK tmpfs /tmp
mount -t tmpfs -o mode=755,size=$DISK tmpfs /workspace
if [ "$AGENTS" = 1 ]; then  # the host's prepared agent CLIs, read-only (QEMU shares them readonly=on as well)
  modprobe -q 9pnet_virtio; modprobe -q 9p
  mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose vimeagents /opt/vime/agents \
    || echo "vime-init: the agents share did not mount" > /dev/console
fi
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
[ "$NET" = 1 ] && echo "nameserver 10.0.2.3" > /run/resolv.conf
mkdir -p /run/sshd
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /sys/fs/cgroup/sandbox
echo +pids > /sys/fs/cgroup/cgroup.subtree_control
[ "$PIDS" -gt 0 ] && echo "$PIDS" > /sys/fs/cgroup/sandbox/pids.max
sh -c 'echo $$ > /sys/fs/cgroup/sandbox/cgroup.procs; exec /usr/sbin/sshd -D -e' 2>/run/sshd.log &
mount -o remount,ro /sys/fs/cgroup
mount -o remount,ro /sys
echo "vime-init: ready" > /dev/console
exec python3 -I -S -c '""" + REAPER_SOURCE + r"""
import os, sys, time
wall = float(sys.argv[1])
vime_reap(time.monotonic() + wall if wall > 0 else None)
os.sync()
' "$WALL"
"""

SSHD_CONFIG = """PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
MaxSessions 256
MaxStartups 256
PidFile /run/sshd.pid
"""


def default_image_dir(suite: str = "bookworm") -> Path:
    return Path(os.environ.get("VIME_CACHE_DIR", Path.home() / ".cache" / "vime")) / "localvm" / suite


def image_format(out: Path) -> int:
    """The ``format`` of the image in ``out`` (1 for images built before formats were recorded, 0 for none)."""
    try:
        return int(json.loads((out / "manifest.json").read_text()).get("format", 1))
    except (OSError, ValueError, AttributeError):
        return 0


def image_ready(out: Path) -> bool:
    """Whether ``out`` holds a complete image (of any format; see :func:`image_format`)."""
    return all((out / f).exists() for f in ("base.qcow2", "vmlinuz", "initrd.img", "id_ed25519", "manifest.json"))


def build_vm_image(
    out: Path | None = None,
    *,
    suite: str = "bookworm",
    mirror: str = DEFAULT_MIRROR,
    size_mb: int = 2048,
    force: bool = False,
    log=print,
) -> Path:
    """Build (or reuse) the base VM image in ``out``.

    :param size_mb: size of the root filesystem, MiB.
    :returns: the image directory.
    :raises RuntimeError: a build step failed (its output included) or a tool is missing.
    """
    out = out or default_image_dir(suite)
    if image_ready(out) and not force:
        if image_format(out) >= IMAGE_FORMAT:
            log(f"vm image: {out} exists, reused")
            return out
        log(f"vm image: {out} has format {image_format(out)} < {IMAGE_FORMAT}: rebuilding (root filesystem reused)")
    for tool in ("debootstrap", "mkfs.ext4", "qemu-img", "ssh-keygen"):
        if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}"):
            raise RuntimeError(f"{tool} not found: apt-get install -y debootstrap e2fsprogs qemu-utils openssh-client")
    out.mkdir(parents=True, exist_ok=True)
    rootfs = out / "rootfs"
    t0 = time.monotonic()
    debootstrap(rootfs, rootfs / ".vime-debootstrap-complete", suite=suite, mirror=mirror, packages=PACKAGES,
                log=lambda m: log(f"vm image: {m}"))
    # a small initramfs: only what a virtio disk boot needs
    conf = rootfs / "etc/initramfs-tools"
    (conf / "initramfs.conf").write_text("MODULES=list\nBUSYBOX=auto\nCOMPRESS=gzip\n")
    (conf / "modules").write_text("virtio_pci\nvirtio_blk\nvirtio_net\nvirtio_rng\next4\n")
    kernels = sorted(p.name.removeprefix("vmlinuz-") for p in (rootfs / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise RuntimeError("no kernel in the root filesystem (linux-image-amd64 missing?)")
    kver = kernels[-1]
    mode = "-u" if (rootfs / f"boot/initrd.img-{kver}").exists() else "-c"
    run_checked(["chroot", str(rootfs), "update-initramfs", mode, "-k", kver])
    shutil.copy(rootfs / f"boot/vmlinuz-{kver}", out / "vmlinuz")
    shutil.copy(rootfs / f"boot/initrd.img-{kver}", out / "initrd.img")
    # guest configuration
    init = rootfs / "usr/local/sbin/vime-init"
    init.write_text(VIME_INIT)
    init.chmod(0o755)
    (rootfs / "workspace").mkdir(exist_ok=True)
    (rootfs / "opt/vime/agents").mkdir(parents=True, exist_ok=True)  # mount point of the agents share
    (rootfs / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (rootfs / "etc/ssh/sshd_config.d/vime.conf").write_text(SSHD_CONFIG)
    (rootfs / "etc/hostname").write_text("sandbox\n")
    (rootfs / "etc/hosts").write_text("127.0.0.1 localhost sandbox\n")
    resolv = rootfs / "etc/resolv.conf"
    if resolv.exists() or resolv.is_symlink():
        resolv.unlink()
    resolv.symlink_to("/run/resolv.conf")
    for key in (rootfs / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    run_checked(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vime-vm-host", "-f",
          str(rootfs / "etc/ssh/ssh_host_ed25519_key")])
    if force or not ((out / "id_ed25519").exists() and (out / "id_ed25519.pub").exists()):
        # a rebuild keeps the login key: VMs booting from the old base.qcow2 meanwhile still accept it
        for f in ("id_ed25519", "id_ed25519.pub"):
            (out / f).unlink(missing_ok=True)
        run_checked(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vime-localvm", "-f",
                     str(out / "id_ed25519")])
    passwd = rootfs / "etc/passwd"  # sshd runs commands through root's shell: dash starts faster than bash
    passwd.write_text(passwd.read_text().replace("root:x:0:0:root:/root:/bin/bash", "root:x:0:0:root:/root:/bin/sh"))
    ssh_dir = rootfs / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text((out / "id_ed25519.pub").read_text())
    (ssh_dir / "authorized_keys").chmod(0o600)
    prune(rootfs)
    # root filesystem → ext4 (no loop device, no mount) → qcow2
    raw = out / "root.img"
    raw.unlink(missing_ok=True)
    run_checked(["mkfs.ext4", "-q", "-F", "-L", "vimeroot", "-E", "root_owner=0:0", "-d", str(rootfs), str(raw),
          f"{size_mb}M"])
    run_checked(["qemu-img", "convert", "-O", "qcow2", str(raw), str(out / "base.qcow2.tmp")])
    (out / "base.qcow2.tmp").replace(out / "base.qcow2")
    raw.unlink()
    (out / "manifest.json").write_text(json.dumps(
        {"suite": suite, "kernel": kver, "packages": PACKAGES, "size_mb": size_mb, "built": time.time(),
         "format": IMAGE_FORMAT}, indent=1))
    log(f"vm image: {out} ready in {time.monotonic() - t0:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    """``vime-sandbox-localvm build-image ...``; returns the exit code."""
    p = argparse.ArgumentParser(prog="vime-sandbox-localvm")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build-image", help="build the base VM image (debootstrap + kernel + openssh → qcow2)")
    b.add_argument("--out", type=Path, default=None)
    b.add_argument("--suite", default="bookworm")
    b.add_argument("--mirror", default=DEFAULT_MIRROR)
    b.add_argument("--size-mb", type=int, default=2048)
    b.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    try:
        print(build_vm_image(a.out, suite=a.suite, mirror=a.mirror, size_mb=a.size_mb, force=a.force))
    except RuntimeError as e:
        print(f"vime-sandbox-localvm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
