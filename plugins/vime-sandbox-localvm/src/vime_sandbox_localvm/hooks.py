"""Hook implementations of vime-sandbox-localvm. Import-light: asyncssh is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_localvm.sandbox import LocalVMSandbox

    register(LocalVMSandbox.NAME, LocalVMSandbox)


@hookimpl
def vime_add_arguments(parser):
    group = parser.add_argument_group("vime-sandbox-localvm")
    group.add_argument("--sandbox-localvm-image-dir", default=None,
                       help="base VM image directory (default ~/.cache/vime/localvm/bookworm; "
                       "make it with `vime-sandbox-localvm build-image`)")
    group.add_argument("--sandbox-localvm-accel", default="auto", choices=["auto", "kvm", "tcg"],
                       help="QEMU accelerator (auto: KVM when /dev/kvm is usable)")
    group.add_argument("--sandbox-localvm-ssh", default=None, metavar="USER@HOST:PORT",
                       help="use this already-running machine instead of booting VMs")
    group.add_argument("--sandbox-localvm-ssh-key", default=None, help="private key for --sandbox-localvm-ssh")
