"""The ``--sandbox-modal-*`` flags of vime-sandbox-modal (a :class:`~vime_core.config.PluginConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core.config import PluginConfig, flag


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
