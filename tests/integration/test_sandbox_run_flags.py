"""`vime run` flags reach the sandbox: `--sandbox NAME` and the generic `--sandbox-*` limits build the backend the
multi-turn generate function's shell tool runs in (one sandbox per episode), for every installed backend that can
run here. The tool output is what the model would see."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.helpers import sandbox_backends
from vime_core.config.context import PluginContext
from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import plugin_context_from_argv

pytestmark = pytest.mark.integration


def _shell_tool_args(backend: str, *extra: str) -> PluginContext:
    """The plugin context of a multi-turn run whose ``bash`` tool runs in the ``backend`` sandbox, plus ``extra``."""
    return plugin_context_from_argv(
        ["--model", "unused", "--generate", "multi_turn", "--multi-turn-sandbox-tool", "bash", "--sandbox", backend]
        + list(extra)
    )


@pytest.mark.parametrize("backend", sandbox_backends())
def test_multi_turn_shell_tool_runs_in_the_chosen_sandbox(backend):
    from vime_core.rollout.generators.multi_turn import _episode_sandbox, _sandbox_tool

    args = _shell_tool_args(backend, "--sandbox-memory-mb", "256", "--sandbox-wall-time", "120")

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


def _scripted_episode(tok, args, script: list[str]):
    """Run the real ``multi_turn`` generate function with a scripted engine: only the sandbox is under test."""
    from vime_core.agent.responders import ScriptedResponder
    from vime_core.rollout.context import RolloutContext, set_rollout_context
    from vime_core.types import Sample

    backend = ScriptedResponder(tok, script)
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=0))
    try:
        generate = get_plugins().resolve("generate", "multi_turn")
        return asyncio.run(generate(args, Sample(prompt="Compute it."), {"temperature": 1.0, "max_tokens": 512}))
    finally:
        set_rollout_context(None)


def _bash_call(command: str) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("backend", sandbox_backends())
def test_multi_turn_generate_runs_code_in_the_sandbox(backend, tok):
    """The generate function end to end on each backend: the model's code runs in the sandbox built from the flags;
    a call at ``--multi-turn-tool-timeout`` is killed *by the sandbox*, so the model sees its partial output and
    ``(timed out)`` — not the caller's bare "timed out" error, which used to win the race when both deadlines were
    the same; the sandbox is gone afterwards."""
    from vime_core.types import Status

    args = _shell_tool_args(backend, "--multi-turn-tool-timeout", "3", "--multi-turn-tools")
    script = [
        _bash_call("python3 -c 'print(6*7)' > out.txt; cat out.txt"),
        _bash_call("echo partial; sleep 60"),
        "done",
    ]
    s = _scripted_episode(tok, args, script)
    assert (s.status, s.metadata["num_turns"], s.metadata["stop_reason"]) == (Status.COMPLETED, 3, "no_tool_call")
    results = [c["result"] for c in s.metadata["tool_calls"]]
    assert results == ["exit code: 0\nstdout:\n42\n", "exit code: 137 (timed out)\nstdout:\npartial\n"]


def test_wall_time_spent_is_reported_to_the_model(tok):
    """A call is capped by what is left of ``--sandbox-wall-time``; after that the model is told the sandbox expired
    (a tool error, not an infrastructure failure: the sample is still scored)."""
    from vime_core.types import Status

    args = _shell_tool_args(
        "local", "--multi-turn-tool-timeout", "60", "--sandbox-wall-time", "3", "--multi-turn-tools"
    )
    s = _scripted_episode(tok, args, [_bash_call("echo started; sleep 60"), _bash_call("echo again"), "done"])
    assert s.status is Status.COMPLETED
    first, second = (c["result"] for c in s.metadata["tool_calls"])
    assert first == "exit code: 137 (timed out)\nstdout:\nstarted\n"
    assert second.startswith("Error: SandboxExpiredError: sandbox vime-local-") and "wall-time limit" in second
