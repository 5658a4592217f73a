"""vime-agent-codex against vime's agent-harness contract kit: the real Codex CLI (npm) against the real agent
gateway (scripted responder, Responses API), in the local sandbox and in docker; plus discovery, flags, config."""

from __future__ import annotations

import json
import shlex

import pytest
from vime_agent_codex.harness import DEFAULT_VERSION, CodexHarness

from vime_core.agent.harness import AgentBudget, AgentEndpoint
from vime_core.plugins.manager import get_plugins
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing import AgentHarnessContract

pytestmark = pytest.mark.contract


def _ctx(argv: list[str]):
    """The plugin context of ``vime run --model m ARGV`` (every other flag at its default)."""
    from vime_core.testing.plugin_context import plugin_context_from_argv

    return plugin_context_from_argv(["--model", "m", *argv])


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
    assert rows["agent-codex"]["provides"] == {"agent": ["codex"], "flags": ["agent-codex"]}
    assert get_plugins().resolve("agent", "codex") is CodexHarness


def test_flags_config_and_command():
    import tomllib

    h = CodexHarness.from_context(_ctx(["--agent-codex-config", 'model_reasoning_effort="low"']))
    assert (h.version, h.config) == (DEFAULT_VERSION, ['model_reasoning_effort="low"'])
    cfg = tomllib.loads(h.config_toml(AgentEndpoint("http://127.0.0.1:9", "sk-1", "policy")))
    assert cfg["model"] == "policy" and cfg["model_provider"] == "vime"
    assert (cfg["approval_policy"], cfg["sandbox_mode"]) == ("never", "danger-full-access")
    assert cfg["model_providers"]["vime"] == {
        "name": "vime",
        "base_url": "http://127.0.0.1:9/v1",
        "env_key": "VIME_API_KEY",
        "wire_api": "responses",
        "supports_websockets": False,
        "request_max_retries": 0,
        "stream_max_retries": 0,
    }
    assert cfg["analytics"] == {"enabled": False}
    assert h.command("/x/codex", "do it", "/w") == [
        "/x/codex",
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "-C",
        "/w",
        "-c",
        'model_reasoning_effort="low"',
        "--",
        "do it",
    ]


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


def test_compact_config_and_instructions_file(tmp_path):
    import tomllib
    from vime_agent_codex.harness import COMPACT_INSTRUCTIONS

    from vime_core.agent.harness import AgentHarnessError

    ep = AgentEndpoint("http://127.0.0.1:9", "sk-1", "policy")
    plain = CodexHarness.from_context(_ctx([]))
    assert (plain.compact, plain.instructions) == (False, None)
    assert list(plain.home_files(ep, "/h")) == ["/h/config.toml"]
    assert "model_instructions_file" not in tomllib.loads(plain.config_toml(ep, "/h"))

    h = CodexHarness.from_context(_ctx(["--agent-codex-compact"]))
    files = h.home_files(ep, "/h")
    assert files["/h/instructions.md"] == COMPACT_INSTRUCTIONS
    cfg = tomllib.loads(files["/h/config.toml"])
    assert cfg["model_instructions_file"] == "/h/instructions.md"
    assert (cfg["include_permissions_instructions"], cfg["web_search"]) == (False, "disabled")
    assert cfg["include_environment_context_time"] is False
    assert cfg["skills"] == {"include_instructions": False, "bundled": {"enabled": False}}
    assert cfg["agents"] == {"enabled": False}
    assert cfg["tools"] == {"experimental_request_user_input": {"enabled": False}}
    assert cfg["features"] == {"goals": False, "view_image": False}
    assert cfg["model_providers"]["vime"]["base_url"] == "http://127.0.0.1:9/v1"  # the rest is unchanged

    (tmp_path / "i.md").write_text("Be brief.\n")
    own = CodexHarness.from_context(_ctx(["--agent-codex-instructions-file", str(tmp_path / "i.md")]))
    files = own.home_files(ep, "/h")
    assert files["/h/instructions.md"] == "Be brief.\n" and "skills" not in tomllib.loads(files["/h/config.toml"])
    with pytest.raises(AgentHarnessError, match="--agent-codex-instructions-file .*missing.md"):
        CodexHarness.from_context(_ctx(["--agent-codex-instructions-file", str(tmp_path / "missing.md")]))


async def run_compact_codex(gw, sid: str):
    """The real CLI in compact mode, in a local sandbox, against ``gw`` as session ``sid``: "Say done.", 2 turns."""
    async with LocalSandbox() as sb:
        addr = await sb.expose_host_port(gw.port)
        return await CodexHarness(compact=True).run(
            sb,
            prompt="Say done.",
            budget=AgentBudget(max_turns=2, wall_time_s=120),
            endpoint=AgentEndpoint(f"http://{addr}", sid, gw.served_model_name),
        )


@pytest.mark.integration
def test_compact_first_request_real_cli(prepared, tmp_path):
    """The real CLI with ``--agent-codex-compact`` sends exactly the compact instructions and the two shell tools
    (what bench/codex_prompt_tokens.py measures: ≈1.1k SmolLM2 tokens; ≈6.7k without compact mode)."""
    import asyncio

    from transformers import AutoTokenizer
    from vime_agent_codex.harness import COMPACT_INSTRUCTIONS

    from vime_core.agent.apis import openai_responses
    from vime_core.agent.gateway import AgentGateway
    from vime_core.agent.responders import ScriptedResponder
    from vime_core.testing.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path / "tiny")))
    backend = ScriptedResponder(tok, ["Done."])
    bodies: list[dict] = []
    orig = openai_responses.parse_responses
    gw = AgentGateway(tok, backend).start()
    openai_responses.parse_responses = lambda body, history=None: bodies.append(body) or orig(body, history)
    try:
        gw.open_session("sk-c", max_turns=2)
        result = asyncio.run(run_compact_codex(gw, "sk-c"))
    finally:
        openai_responses.parse_responses = orig
        gw.stop()
    assert result.status == "completed" and len(backend.calls) == 1 == len(bodies)
    body = bodies[0]
    assert [t.get("name") for t in body["tools"]] == ["exec_command", "write_stdin"]
    msgs = [(m["role"], "".join(c.get("text", "") for c in m["content"])) for m in body["input"]]
    assert msgs[0] == ("developer", COMPACT_INSTRUCTIONS.strip())  # Codex trims the file's final newline
    assert [r for r, _ in msgs] == ["developer", "user", "user"]  # instructions, environment_context, the prompt
    assert msgs[1][1].lstrip().startswith("<environment_context>") and msgs[2][1] == "Say done."
    assert "<cwd>" in msgs[1][1] and "<current_date>" not in msgs[1][1]


@pytest.mark.integration
def test_context_window_exceeded_is_recognised_by_codex(prepared, tmp_path):
    """A session whose context window (300 tokens) is smaller than Codex's first request: the gateway fails the
    streamed response with code ``context_length_exceeded``, which the real CLI recognises (its own "ran out of room
    in the model's context window" error, no retries), and the episode records that its context ran out."""
    import asyncio

    from transformers import AutoTokenizer

    from vime_core.agent.gateway import AgentGateway
    from vime_core.agent.responders import ScriptedResponder
    from vime_core.testing.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path / "tiny")))
    backend = ScriptedResponder(tok, ["Done."])
    with AgentGateway(tok, backend) as gw:
        gw.open_session("sk-x", max_context_len=300)
        result = asyncio.run(run_compact_codex(gw, "sk-x"))
        overflows = gw._sessions["sk-x"].context_overflows
    out = result.stdout + result.stderr
    assert "ran out of room in the model's context window" in out, out[-3000:]
    assert (overflows, backend.calls) == (1, [])  # not retried, refused before the engine, recorded
