"""Hook implementations of vime-sandbox-modal. Import-light: ``modal`` is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl
from vime_sandbox_modal.flags import ModalFlags


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_modal.sandbox import ModalSandbox

    register(ModalSandbox.NAME, ModalSandbox)


@hookimpl
def vime_register_flags(register):
    register(ModalFlags.PREFIX, ModalFlags)
