"""vime-agent-claude-code against vime's agent-harness contract kit: the real Claude Code CLI (npm) against the real
agent gateway (scripted responder), in the local sandbox and in docker; plus discovery, flags and the command."""

from __future__ import annotations

import json
import shlex

import pytest
from vime_agent_claude_code.harness import DEFAULT_TOOLS, DEFAULT_VERSION, ClaudeCodeHarness

from vime_core.agent.harness import AgentBudget, AgentEndpoint
from vime_core.plugins import get_plugins
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing import AgentHarnessContract

pytestmark = pytest.mark.contract


def call(name: str, arguments: dict) -> str:
    """One assistant turn calling a tool, in the Hermes format the gateway parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def write_turns(path: str, content: str) -> list[str]:
    cmd = f"printf %s {shlex.quote(content)} > {shlex.quote(path)}"
    return [call("Bash", {"command": cmd, "description": "write the file"}), f"Wrote {path}."]


def sleep_turns(seconds: int) -> list[str]:
    return [call("Bash", {"command": f"sleep {seconds}", "timeout": 600000})] * 4


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["agent-claude-code"]["distribution"] == "vime-agent-claude-code"
    assert rows["agent-claude-code"]["provides"] == {"agent": ["claude-code"]}
    assert get_plugins().resolve("agent", "claude-code") is ClaudeCodeHarness


def test_flags_and_command():
    import argparse

    from vime_agent_claude_code.hooks import vime_add_arguments

    parser = argparse.ArgumentParser()
    vime_add_arguments(parser)
    h = ClaudeCodeHarness.from_args(parser.parse_args(["--agent-claude-code-tools", "Bash,Read"]))
    assert (h.version, h.tools, h.bare) == (DEFAULT_VERSION, ["Bash", "Read"], True)
    assert ClaudeCodeHarness.from_args(parser.parse_args([])).tools == list(DEFAULT_TOOLS)
    ep = AgentEndpoint("http://127.0.0.1:9", "sk-1", "policy")
    argv = h.command("/x/claude", "do it", ep, AgentBudget(max_turns=3, max_tokens=100))
    assert argv == ["/x/claude", "-p", "do it", "--output-format", "json", "--model", "policy",
                    "--dangerously-skip-permissions", "--no-session-persistence", "--max-turns", "3", "--bare",
                    "--tools", "Bash,Read"]
    env = h.environment(ep, AgentBudget(max_tokens=100), "/tmp/h")
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"], env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == (
        "http://127.0.0.1:9", "sk-1", "100")
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["ANTHROPIC_SMALL_FAST_MODEL"] == "policy"


@pytest.fixture(scope="module")
def prepared() -> ClaudeCodeHarness:
    h = ClaudeCodeHarness()
    h.prepare()  # npm, cached under ~/.cache/vime/agents (scripts/install.sh prepares it)
    return h


class _Turns:
    @pytest.fixture
    def write_file_turns(self):
        return write_turns

    @pytest.fixture
    def sleep_turns(self):
        return sleep_turns


@pytest.mark.integration
class TestClaudeCodeLocal(_Turns, AgentHarnessContract):
    @pytest.fixture
    def harness(self, prepared):
        return prepared

    @pytest.fixture
    def sandbox_factory(self):
        return lambda **kw: LocalSandbox(**kw)


@pytest.mark.integration
class TestClaudeCodeDocker(_Turns, AgentHarnessContract):
    @pytest.fixture
    def harness(self, prepared):
        return prepared

    @pytest.fixture
    def sandbox_factory(self, docker_image):
        from vime_sandbox_docker.sandbox import DockerSandbox

        return lambda **kw: DockerSandbox(image=docker_image, **kw)
