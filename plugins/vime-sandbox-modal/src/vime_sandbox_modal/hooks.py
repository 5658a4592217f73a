"""Hook implementations of vime-sandbox-modal. Import-light: ``modal`` is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_modal.sandbox import ModalSandbox

    register(ModalSandbox.NAME, ModalSandbox)


@hookimpl
def vime_add_arguments(parser):
    group = parser.add_argument_group("vime-sandbox-modal")
    group.add_argument(
        "--sandbox-modal-image",
        default="python:3.12-slim",
        help="registry image of modal sandboxes (needs /bin/sh, coreutils, tar, python3); "
        "credentials come from MODAL_TOKEN_ID/MODAL_TOKEN_SECRET",
    )
    group.add_argument(
        "--sandbox-modal-app", default="vime-sandboxes", help="Modal app the sandboxes belong to (created if missing)"
    )
