"""vime-sandbox-docker against vime's sandbox contract kit, on a real dockerd; and its discovery and flags."""

from __future__ import annotations

import asyncio

import pytest
from vime_sandbox_docker.sandbox import DockerSandbox, docker_client, leftover_counts

from vime_core.plugins.manager import get_plugins
from vime_core.testing import SandboxBackendContract

pytestmark = pytest.mark.contract


def _ctx(argv: list[str]):
    """The plugin context of ``vime run --model m ARGV`` (every other flag at its default)."""
    from vime_core.testing.plugin_context import plugin_context_from_argv

    return plugin_context_from_argv(["--model", "m", *argv])


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["sandbox-docker"]["distribution"] == "vime-sandbox-docker"
    assert rows["sandbox-docker"]["provides"] == {"sandbox": ["docker"], "flags": ["sandbox-docker"]}
    assert get_plugins().resolve("sandbox", "docker") is DockerSandbox


def test_flags_reach_from_args():
    from vime_sandbox_docker.sandbox import DockerFlags

    from vime_core.cli.arguments import build_parser

    assert "--sandbox-docker-image" in build_parser()._option_string_actions
    ctx = _ctx(["--sandbox-docker-image", "img:1", "--sandbox-network", "--sandbox-memory-mb", "256"])
    sb = DockerSandbox.from_context(ctx)
    assert (sb.image, sb.network, sb.read_only, sb.base_url) == ("img:1", True, True, None)
    assert (sb.limits.memory_bytes, sb.limits.pids) == (256 << 20, 512)
    assert DockerSandbox.from_context(ctx, network=False).network is False
    assert DockerSandbox.from_config(ctx.sandbox, ctx.plugin(DockerFlags)).image == "img:1"


def test_missing_image_is_an_infra_error(docker_image):
    from vime_core.sandbox import SandboxInfraError

    async def body():
        async with DockerSandbox(image="vime-no-such-image:0"):
            pass

    with pytest.raises(SandboxInfraError, match="build-image"):
        asyncio.run(body())


@pytest.mark.integration
class TestDockerSandbox(SandboxBackendContract):
    capabilities = set(DockerSandbox.capabilities)

    @pytest.fixture
    def sandbox_factory(self, docker_image):
        return lambda **kw: DockerSandbox(image=docker_image, **kw)

    @pytest.fixture
    def sandbox_exists(self):
        client = docker_client()

        def exists(sb: DockerSandbox) -> bool:
            flt = {"label": f"vime.sandbox={sb.sandbox_id}"}
            return bool(client.containers.list(all=True, filters=flt) or client.volumes.list(filters=flt))

        return exists

    @pytest.fixture
    def sandbox_leftovers(self):
        return lambda ids: leftover_counts(ids=ids)  # containers and volumes by label, host-port directories

    @pytest.fixture
    def sabotage(self):
        async def remove_container(sb: DockerSandbox) -> None:
            await asyncio.to_thread(docker_client().api.remove_container, sb.container_id, force=True)

        return remove_container
