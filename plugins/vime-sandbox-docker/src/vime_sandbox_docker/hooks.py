"""Hook implementations of vime-sandbox-docker. Import-light: the ``docker`` SDK is imported only when used."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_docker.sandbox import DockerSandbox

    register(DockerSandbox.NAME, DockerSandbox)


@hookimpl
def vime_register_flags(register):
    from vime_sandbox_docker.sandbox import DockerFlags

    register(DockerFlags.PREFIX, DockerFlags)
