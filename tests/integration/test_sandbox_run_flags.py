"""`vime run` flags reach the sandbox: `--sandbox NAME` and the generic `--sandbox-*` limits build the backend the
multi-turn generate function's shell tool runs in (one sandbox per episode), for every installed backend that can
run here. The tool output is what the model would see."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.arguments import build_parser
from vime_core.plugins import get_plugins

pytestmark = pytest.mark.integration


def _backends() -> list[str]:
    names = ["local"]
    if "docker" in get_plugins().registries["sandbox"].names():
        try:
            from vime_sandbox_docker.sandbox import docker_client

            docker_client(timeout_s=10).images.get("vime-sandbox:bookworm")
            names.append("docker")
        except Exception as e:  # noqa: BLE001 - report why docker is left out
            print(f"docker left out: {e}")
    return names


@pytest.mark.parametrize("backend", _backends())
def test_multi_turn_shell_tool_runs_in_the_chosen_sandbox(backend):
    from vime_core.rollout.multi_turn import _episode_sandbox, _sandbox_tool

    args = build_parser().parse_args(
        ["--model", "unused", "--generate", "multi_turn", "--multi-turn-sandbox-tool", "bash", "--sandbox", backend,
         "--sandbox-memory-mb", "256", "--sandbox-wall-time", "120"]
    )

    async def body():
        async with _episode_sandbox(args) as sb:
            assert type(sb).NAME == backend
            assert (sb.limits.memory_bytes, sb.limits.wall_time_s, sb.network) == (256 << 20, 120.0, False)
            tool = _sandbox_tool("bash", sb, 10.0)
            ok = await tool.call({"command": "python3 -c 'print(6*7)'"}, timeout_s=60.0)
            slow = await tool.call({"command": "sleep 30"}, timeout_s=60.0)  # the sandbox's own 10 s timeout
            return ok, slow

    ok, slow = asyncio.run(body())
    assert ok == "exit code: 0\nstdout:\n42\n"
    assert slow.startswith("exit code: 137 (timed out)")
