"""vime-sandbox-e2b: the real ``e2b`` SDK against the fake E2B service on 127.0.0.1 (:mod:`vime_sandbox_e2b.testing`),
through vime's sandbox contract kit; plus discovery, flags and the exact requests the plugin makes."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from vime_sandbox_e2b.sandbox import WALL_TIME_GRACE_S, E2BSandbox

from vime_core.plugins.manager import get_plugins
from vime_core.sandbox import SandboxInfraError, SandboxLimits, owner_token
from vime_core.testing import SandboxBackendContract

pytestmark = pytest.mark.contract


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["sandbox-e2b"]["distribution"] == "vime-sandbox-e2b"
    assert rows["sandbox-e2b"]["provides"] == {"sandbox": ["e2b"], "flags": ["sandbox-e2b"]}
    assert get_plugins().resolve("sandbox", "e2b") is E2BSandbox


def test_flags_reach_the_sandbox():
    from vime_core.testing.plugin_context import plugin_context_from_argv

    ctx = plugin_context_from_argv(
        ["--model", "m", "--sandbox", "e2b", "--sandbox-e2b-template", "py-3", "--sandbox-wall-time", "90"]
    )
    sb = E2BSandbox.from_context(ctx)
    assert (sb.template, sb.network, sb.limits.wall_time_s, sb._e2b_timeout()) == (
        "py-3",
        False,
        90.0,
        90 + WALL_TIME_GRACE_S,
    )


def test_no_api_key_is_an_infra_error(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)

    async def body():
        async with E2BSandbox():
            pass

    with pytest.raises(SandboxInfraError, match="E2B_API_KEY"):
        asyncio.run(body())


def test_create_request_labels_network_and_timeout(e2b_env):
    """What the plugin asks E2B for: vime labels as metadata, no internet by default, wall time + grace."""
    fake = e2b_env

    async def body():
        async with E2BSandbox(limits=SandboxLimits(wall_time_s=100), env={"A": "1"}) as sb:
            req = fake.created[-1]
            assert req["metadata"] == {
                "vime.sandbox": sb.sandbox_id,
                "vime.owner": owner_token(),
                "vime.backend": "e2b",
            }
            assert (req["templateID"], req["allow_internet_access"], req["timeout"], req["envVars"]) == (
                "base",
                False,
                100 + WALL_TIME_GRACE_S,
                {"A": "1"},
            )
            assert (await sb.exec('printf %s "$A"', timeout=30)).stdout == "1"
        async with E2BSandbox(network=True):
            assert fake.created[-1]["allow_internet_access"] is True

    asyncio.run(body())


def test_reaper_kills_sandboxes_of_dead_owners(e2b_env):
    """A sandbox whose vime.owner process is gone is killed by cleanup(); live owners' are kept."""
    fake = e2b_env

    async def body():
        async with E2BSandbox() as live:
            orphan = E2BSandbox()
            await orphan.start()
            orphan_id = orphan.e2b_sandbox_id
            gone = subprocess.Popen(["sleep", "30"])
            token = owner_token(gone.pid)
            gone.kill()
            gone.wait()
            fake.sandboxes[orphan_id].metadata["vime.owner"] = token  # as if a process now gone had made it
            orphan._sbx = None  # vime forgets it, as a killed process would
            report = await asyncio.to_thread(E2BSandbox.cleanup)
            assert [r.split()[0] for r in report.removed] == [orphan_id]
            assert orphan_id not in fake.sandboxes and live.e2b_sandbox_id in fake.sandboxes
            await orphan.close()

    asyncio.run(body())


@pytest.mark.integration
class TestE2BSandbox(SandboxBackendContract):
    """The contract against the fake. Declared: network isolation (the plugin asks for
    ``allow_internet_access=False``; the fake enforces it with a network namespace, as E2B's firewall would),
    detached commands, wall time (vime's own deadline plus E2B's timeout), the reaper. Not declared (E2B cannot
    per sandbox): resource limits, arbitrary users, a read-only root."""

    capabilities = set(E2BSandbox.capabilities)
    isolated_interfaces = None  # an E2B sandbox keeps its interface; outbound traffic is what is blocked

    @pytest.fixture
    def sandbox_factory(self, e2b_env):
        return lambda **kw: E2BSandbox(**kw)

    @pytest.fixture
    def sandbox_exists(self, e2b_env):
        def exists(sb: E2BSandbox) -> bool:
            fake_sb = e2b_env.sandboxes.get(sb.e2b_sandbox_id or "")
            return fake_sb is not None and not fake_sb.local.closed

        return exists

    @pytest.fixture
    def sandbox_leftovers(self, e2b_env):
        def left(ids: set[str]) -> dict[str, int]:  # the fake service's registry, and the local sandboxes behind it
            boxes = [sb for sb in list(e2b_env.sandboxes.values()) if sb.metadata.get("vime.sandbox") in ids]
            return {"sandboxes": len(boxes), "running": sum(not sb.local.closed for sb in boxes)}

        return left

    @pytest.fixture
    def sabotage(self, e2b_env):
        async def kill_on_the_server(sb: E2BSandbox) -> None:
            fake_sb = e2b_env.sandboxes.pop(sb.e2b_sandbox_id)
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fake_sb.kill(), e2b_env._loop))

        return kill_on_the_server


def test_multi_turn_shell_tool_runs_in_e2b(e2b_env):
    """`--generate multi_turn --multi-turn-sandbox-tool bash --sandbox e2b`: the episode's sandbox is built from the
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
            "e2b",
            "--multi-turn-tool-timeout",
            "2",
            "--sandbox-wall-time",
            "120",
        ]
    )

    async def body():
        async with _episode_sandbox(args) as sb:
            assert isinstance(sb, E2BSandbox) and (sb.limits.wall_time_s, sb.network) == (120.0, False)
            tools = {"bash": _sandbox_tool("bash", sb, 2.0)}
            ok = await _run_tool(tools, ToolCall("bash", {"command": "python3 -c 'print(6*7)'"}), 2.0)
            slow = await _run_tool(tools, ToolCall("bash", {"command": "echo partial; sleep 30"}), 2.0)
            return ok, slow

    assert asyncio.run(body()) == ("exit code: 0\nstdout:\n42\n", "exit code: 137 (timed out)\nstdout:\npartial\n")
