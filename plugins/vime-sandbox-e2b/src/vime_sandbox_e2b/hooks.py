"""Hook implementations of vime-sandbox-e2b. Import-light: the ``e2b`` SDK is imported only when a sandbox starts."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core import hookimpl
from vime_core.config import PluginConfig, flag


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_e2b.sandbox import E2BSandbox

    register(E2BSandbox.NAME, E2BSandbox)


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


@hookimpl
def vime_register_flags(register):
    register(E2BFlags.PREFIX, E2BFlags)
