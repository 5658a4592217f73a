"""Hook implementations of vime-sandbox-modal. Import-light: ``modal`` is imported only when a sandbox starts."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core import hookimpl
from vime_core.config import PluginConfig, flag


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_modal.sandbox import ModalSandbox

    register(ModalSandbox.NAME, ModalSandbox)


@dataclass(frozen=True, kw_only=True)
class ModalFlags(PluginConfig):
    """The ``--sandbox-modal-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "sandbox-modal"
    TITLE = "vime-sandbox-modal"

    sandbox_modal_image: str = flag(
        default="python:3.12-slim",
        help="registry image of modal sandboxes (needs /bin/sh, coreutils, tar, python3); "
        "credentials come from MODAL_TOKEN_ID/MODAL_TOKEN_SECRET",
    )
    sandbox_modal_app: str = flag(
        default="vime-sandboxes", help="Modal app the sandboxes belong to (created if missing)"
    )


@hookimpl
def vime_register_flags(register):
    register(ModalFlags.PREFIX, ModalFlags)
