"""vime-agent-codex against vime's agent-harness contract kit: the real Codex CLI (npm) against the real agent
gateway (scripted responder, Responses API), in the local sandbox and in docker; plus discovery, flags, config."""

from __future__ import annotations

import json
import shlex

import pytest
from vime_agent_codex.harness import DEFAULT_VERSION, CodexHarness

from vime_core.agent.harness import AgentEndpoint
from vime_core.plugins import get_plugins
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing import AgentHarnessContract

pytestmark = pytest.mark.contract


def call(name: str, arguments: dict) -> str:
    """One assistant turn calling a tool, in the Hermes format the gateway parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def write_turns(path: str, content: str) -> list[str]:
    cmd = f"printf %s {shlex.quote(content)} > {shlex.quote(path)}"
    return [call("exec_command", {"cmd": cmd}), f"Wrote {path}."]


def sleep_turns(seconds: int) -> list[str]:
    # exec_command yields back to the model after yield_time_ms: keep the agent busy with more sleeps
    return [call("exec_command", {"cmd": f"sleep {seconds}", "yield_time_ms": 30000})] * 8


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["agent-codex"]["distribution"] == "vime-agent-codex"
    assert rows["agent-codex"]["provides"] == {"agent": ["codex"]}
    assert get_plugins().resolve("agent", "codex") is CodexHarness


def test_flags_config_and_command():
    import argparse

    import tomllib
    from vime_agent_codex.hooks import vime_add_arguments

    parser = argparse.ArgumentParser()
    vime_add_arguments(parser)
    h = CodexHarness.from_args(parser.parse_args(["--agent-codex-config", 'model_reasoning_effort="low"']))
    assert (h.version, h.config) == (DEFAULT_VERSION, ['model_reasoning_effort="low"'])
    cfg = tomllib.loads(h.config_toml(AgentEndpoint("http://127.0.0.1:9", "sk-1", "policy")))
    assert cfg["model"] == "policy" and cfg["model_provider"] == "vime"
    assert (cfg["approval_policy"], cfg["sandbox_mode"]) == ("never", "danger-full-access")
    assert cfg["model_providers"]["vime"] == {
        "name": "vime", "base_url": "http://127.0.0.1:9/v1", "env_key": "VIME_API_KEY", "wire_api": "responses",
        "supports_websockets": False, "request_max_retries": 0, "stream_max_retries": 0,
    }
    assert cfg["analytics"] == {"enabled": False}
    assert h.command("/x/codex", "do it", "/w") == [
        "/x/codex", "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--color", "never", "-C", "/w",
        "-c", 'model_reasoning_effort="low"', "--", "do it"]


@pytest.fixture(scope="module")
def prepared() -> CodexHarness:
    h = CodexHarness()
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
class TestCodexLocal(_Turns, AgentHarnessContract):
    @pytest.fixture
    def harness(self, prepared):
        return prepared

    @pytest.fixture
    def sandbox_factory(self):
        return lambda **kw: LocalSandbox(**kw)


@pytest.mark.integration
class TestCodexDocker(_Turns, AgentHarnessContract):
    @pytest.fixture
    def harness(self, prepared):
        return prepared

    @pytest.fixture
    def sandbox_factory(self, docker_image):
        from vime_sandbox_docker.sandbox import DockerSandbox

        return lambda **kw: DockerSandbox(image=docker_image, **kw)
