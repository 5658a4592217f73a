"""The ``--sandbox-localvm-*`` flags of vime-sandbox-localvm (a :class:`~vime_core.config.PluginConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core.config import PluginConfig, flag


@dataclass(frozen=True, kw_only=True)
class LocalVMFlags(PluginConfig):
    """The ``--sandbox-localvm-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "sandbox-localvm"
    TITLE = "vime-sandbox-localvm"

    sandbox_localvm_image_dir: str | None = flag(
        default=None,
        help="base VM image directory (default ~/.cache/vime/localvm/bookworm; "
        "make it with `vime-sandbox-localvm build-image`)",
    )
    sandbox_localvm_accel: str = flag(
        default="auto", choices=["auto", "kvm", "tcg"], help="QEMU accelerator (auto: KVM when /dev/kvm is usable)"
    )
    sandbox_localvm_ssh: str | None = flag(
        default=None, metavar="USER@HOST:PORT", help="use this already-running machine instead of booting VMs"
    )
    sandbox_localvm_ssh_key: str | None = flag(default=None, help="private key for --sandbox-localvm-ssh")
