"""Hook implementations of vime-sandbox-docker. Import-light: the ``docker`` SDK is imported only when used."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_sandbox_docker.sandbox import DockerSandbox

    register(DockerSandbox.NAME, DockerSandbox)


@hookimpl
def vime_add_arguments(parser):
    from vime_sandbox_docker.sandbox import DEFAULT_IMAGE

    group = parser.add_argument_group("vime-sandbox-docker")
    group.add_argument("--sandbox-docker-image", default=DEFAULT_IMAGE,
                       help="local image of docker sandboxes (build it with `vime-sandbox-docker build-image`)")
    group.add_argument("--sandbox-docker-host", default=None,
                       help="docker daemon address (default: DOCKER_HOST or the local socket)")
    group.add_argument("--sandbox-docker-writable-root", action="store_true",
                       help="writable root filesystem (default: read-only except /workspace and /tmp)")
