"""vime-sandbox-modal: the real ``modal`` SDK against the fake Modal service on 127.0.0.1
(:mod:`vime_sandbox_modal.testing`, gRPC), through vime's sandbox contract kit; plus discovery, flags and the exact
creation request the plugin makes."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from vime_sandbox_modal.sandbox import WALL_TIME_GRACE_S, ModalSandbox

from vime_core.plugins.manager import get_plugins
from vime_core.sandbox import SandboxInfraError, SandboxLimits, owner_token
from vime_core.testing import SandboxBackendContract

pytestmark = pytest.mark.contract


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["sandbox-modal"]["distribution"] == "vime-sandbox-modal"
    assert rows["sandbox-modal"]["provides"] == {"sandbox": ["modal"], "flags": ["sandbox-modal"]}
    assert get_plugins().resolve("sandbox", "modal") is ModalSandbox


def test_flags_reach_the_sandbox():
    from vime_core.testing.plugin_context import plugin_context_from_argv

    ctx = plugin_context_from_argv(
        [
            "--model",
            "m",
            "--sandbox",
            "modal",
            "--sandbox-modal-image",
            "python:3.11",
            "--sandbox-modal-app",
            "a1",
            "--sandbox-wall-time",
            "90",
            "--sandbox-memory-mb",
            "256",
        ]
    )
    sb = ModalSandbox.from_context(ctx)
    assert (sb.image, sb.app_name, sb.network, sb._modal_timeout(), sb.limits.memory_bytes) == (
        "python:3.11",
        "a1",
        False,
        90 + WALL_TIME_GRACE_S,
        256 << 20,
    )


def test_no_credentials_is_an_infra_error(monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)

    async def body():
        async with ModalSandbox():
            pass

    with pytest.raises(SandboxInfraError, match="MODAL_TOKEN_ID"):
        asyncio.run(body())


def test_create_request_tags_network_limits_and_timeout(modal_env):
    """What the plugin asks Modal for: vime labels as tags, network access BLOCKED by default, the CPU and memory
    limits, wall time + grace, the image."""
    from modal_proto import api_pb2

    fake = modal_env
    limits = SandboxLimits(wall_time_s=100, cpus=0.5, memory_bytes=300 << 20)

    async def body():
        async with ModalSandbox(limits=limits, env={"A": "1"}) as sb:
            req = fake.created[-1]
            d = req.definition
            assert {t.tag_name: t.tag_value for t in req.tags} == {
                "vime.sandbox": sb.sandbox_id,
                "vime.owner": owner_token(),
                "vime.backend": "modal",
            }
            blocked = api_pb2.NetworkAccess.NetworkAccessType.BLOCKED
            assert (
                d.network_access.network_access_type,
                d.timeout_secs,
                d.resources.milli_cpu,
                d.resources.memory_mb,
            ) == (blocked, 100 + WALL_TIME_GRACE_S, 500, 300)
            assert list(d.entrypoint_args) == ["sleep", "infinity"]
            assert (await sb.exec('printf %s "$A"', timeout=30)).stdout == "1"
        async with ModalSandbox(network=True):
            open_ = api_pb2.NetworkAccess.NetworkAccessType.OPEN
            assert fake.created[-1].definition.network_access.network_access_type == open_
        assert fake.unimplemented == []

    asyncio.run(body())


def test_reaper_terminates_sandboxes_of_dead_owners(modal_env):
    """A sandbox whose vime.owner process is gone is terminated by cleanup(); live owners' are kept."""
    fake = modal_env

    async def body():
        async with ModalSandbox() as live:
            orphan = ModalSandbox()
            await orphan.start()
            orphan_id = orphan.modal_sandbox_id
            gone = subprocess.Popen(["sleep", "30"])
            token = owner_token(gone.pid)
            gone.kill()
            gone.wait()
            fake.sandboxes[orphan_id].tags["vime.owner"] = token  # as if a process now gone had made it
            orphan._sb = None  # vime forgets it, as a killed process would
            report = await asyncio.to_thread(ModalSandbox.cleanup)
            assert [r.split()[0] for r in report.removed] == [orphan_id]
            assert fake.sandboxes[orphan_id].result is not None
            assert fake.sandboxes[live.modal_sandbox_id].result is None
            await orphan.close()

    asyncio.run(body())


@pytest.mark.integration
class TestModalSandbox(SandboxBackendContract):
    """The contract against the fake. Declared: network isolation (the plugin asks for ``block_network=True``;
    the fake enforces it with a network namespace), detached commands, wall time (vime's own deadline plus Modal's
    timeout), the reaper. Not declared (Modal cannot per sandbox): pids/disk limits, other users, a read-only
    root."""

    capabilities = set(ModalSandbox.capabilities)
    isolated_interfaces = None  # a Modal sandbox's interfaces are Modal's business; outbound traffic is checked

    @pytest.fixture
    def sandbox_factory(self, modal_env):
        return lambda **kw: ModalSandbox(**kw)

    @pytest.fixture
    def sandbox_exists(self, modal_env):
        def exists(sb: ModalSandbox) -> bool:
            fake_sb = modal_env.sandboxes.get(sb.modal_sandbox_id or "")
            return fake_sb is not None and fake_sb.result is None and not fake_sb.local.closed

        return exists

    @pytest.fixture
    def sandbox_leftovers(self, modal_env):
        def left(ids: set[str]) -> dict[str, int]:  # the fake service's registry, and the local sandboxes behind it
            boxes = [sb for sb in list(modal_env.sandboxes.values()) if sb.tags.get("vime.sandbox") in ids]
            # Modal lists a terminated sandbox (with its result) for a while: only those not terminated count
            live = sum(sb.result is None for sb in boxes)
            return {"sandboxes": live, "running": sum(not sb.local.closed for sb in boxes)}

        return left

    @pytest.fixture
    def sabotage(self, modal_env):
        async def terminate_on_the_server(sb: ModalSandbox) -> None:
            fake_sb = modal_env.sandboxes[sb.modal_sandbox_id]
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fake_sb.terminate(), modal_env._loop))

        return terminate_on_the_server


def test_multi_turn_shell_tool_runs_in_modal(modal_env):
    """`--generate multi_turn --multi-turn-sandbox-tool bash --sandbox modal`: the episode's sandbox is built from the
    flags and the model's commands run in it; at `--multi-turn-tool-timeout` the sandbox kills the command and the
    model sees its partial output."""
    from vime_core.agent.tool_parsers import ToolCall
    from vime_core.rollout.generators.multi_turn import _episode_sandbox, _run_tool, _sandbox_tool
    from vime_core.testing.plugin_context import plugin_context_from_argv

    args = plugin_context_from_argv(
        [
            "--model",
            "unused",
            "--generate",
            "multi_turn",
            "--multi-turn-sandbox-tool",
            "bash",
            "--sandbox",
            "modal",
            "--multi-turn-tool-timeout",
            "2",
            "--sandbox-wall-time",
            "120",
        ]
    )

    async def body():
        async with _episode_sandbox(args) as sb:
            assert isinstance(sb, ModalSandbox) and (sb.limits.wall_time_s, sb.network) == (120.0, False)
            tools = {"bash": _sandbox_tool("bash", sb, 2.0)}
            ok = await _run_tool(tools, ToolCall("bash", {"command": "python3 -c 'print(6*7)'"}), 2.0)
            slow = await _run_tool(tools, ToolCall("bash", {"command": "echo partial; sleep 30"}), 2.0)
            return ok, slow

    assert asyncio.run(body()) == ("exit code: 0\nstdout:\n42\n", "exit code: 137 (timed out)\nstdout:\npartial\n")
