"""The ``--sandbox-e2b-*`` flags of vime-sandbox-e2b (a :class:`~vime_core.config.PluginConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core.config import PluginConfig, flag


@dataclass(frozen=True, kw_only=True)
class E2BFlags(PluginConfig):
    """The ``--sandbox-e2b-*`` flags (registered through ``vime_register_flags``): ``--sandbox-e2b-template``."""

    PREFIX = "sandbox-e2b"
    TITLE = "vime-sandbox-e2b"

    sandbox_e2b_template: str = flag(
        default="base",
        help="E2B template of e2b sandboxes (needs /bin/sh, coreutils, tar, python3); "
        "the API key comes from E2B_API_KEY",
    )
