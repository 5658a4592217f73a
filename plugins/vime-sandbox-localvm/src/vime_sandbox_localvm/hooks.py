"""Hook implementations of vime-sandbox-localvm. Import-light: asyncssh is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl
from vime_sandbox_localvm.flags import LocalVMFlags


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_localvm.sandbox import LocalVMSandbox

    register(LocalVMSandbox.NAME, LocalVMSandbox)


@hookimpl
def vime_register_flags(register):
    register(LocalVMFlags.PREFIX, LocalVMFlags)
