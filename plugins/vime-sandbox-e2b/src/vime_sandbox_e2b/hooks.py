"""Hook implementations of vime-sandbox-e2b. Import-light: the ``e2b`` SDK is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl
from vime_sandbox_e2b.flags import E2BFlags


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_e2b.sandbox import E2BSandbox

    register(E2BSandbox.NAME, E2BSandbox)


@hookimpl
def vime_register_flags(register):
    register(E2BFlags.PREFIX, E2BFlags)
