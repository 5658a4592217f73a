"""Hook implementations of vime-sandbox-e2b. Import-light: the ``e2b`` SDK is imported only when a sandbox starts."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_e2b.sandbox import E2BSandbox

    register(E2BSandbox.NAME, E2BSandbox)


@hookimpl
def vime_add_arguments(parser):
    group = parser.add_argument_group("vime-sandbox-e2b")
    group.add_argument(
        "--sandbox-e2b-template",
        default="base",
        help="E2B template of e2b sandboxes (needs /bin/sh, coreutils, tar, python3); "
        "the API key comes from E2B_API_KEY",
    )
