"""Hook implementations of vime-sandbox-docker. Import-light: the ``docker`` SDK is imported only when used."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_docker.sandbox import DockerSandbox

    register(DockerSandbox.NAME, DockerSandbox)


@hookimpl
def vime_add_arguments(parser):
    from vime_sandbox_docker.sandbox import add_arguments

    add_arguments(parser)
