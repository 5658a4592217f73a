"""vime-agent-claude-code against vime's agent-harness contract kit: the real Claude Code CLI (npm) against the real
agent gateway (scripted responder), in the local sandbox and in docker; plus discovery, flags and the command."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from vime_agent_claude_code.harness import DEFAULT_TOOLS, DEFAULT_VERSION, ClaudeCodeHarness

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
    return [call("Bash", {"command": cmd, "description": "write the file"}), f"Wrote {path}."]


def sleep_turns(seconds: int) -> list[str]:
    return [call("Bash", {"command": f"sleep {seconds}", "timeout": 600000})] * 4


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["agent-claude-code"]["distribution"] == "vime-agent-claude-code"
    assert rows["agent-claude-code"]["provides"] == {"agent": ["claude-code"], "flags": ["agent-claude-code"]}
    assert get_plugins().resolve("agent", "claude-code") is ClaudeCodeHarness


def test_flags_and_command():
    h = ClaudeCodeHarness.from_context(_ctx(["--agent-claude-code-tools", "Bash,Read"]))
    assert (h.version, h.tools, h.bare) == (DEFAULT_VERSION, ["Bash", "Read"], True)
    full = ClaudeCodeHarness.from_context(_ctx([]))
    assert (full.tools, full.bare) == (list(DEFAULT_TOOLS), False)  # Write is not in --bare's pool
    assert ClaudeCodeHarness.from_context(_ctx(["--agent-claude-code-tools", "Bash,Write"])).bare is False
    assert ClaudeCodeHarness.from_context(_ctx(["--agent-claude-code-tools", ""])).bare is False
    assert (
        ClaudeCodeHarness.from_context(_ctx(["--agent-claude-code-tools", "Bash", "--agent-claude-code-no-bare"])).bare
        is False
    )
    with pytest.raises(ValueError, match="--agent-claude-code-tools asks for Write"):
        ClaudeCodeHarness(tools=["Bash", "Write"], bare=True)
    ep = AgentEndpoint("http://127.0.0.1:9", "sk-1", "policy")
    argv = h.command("/x/claude", "do it", ep, AgentBudget(max_turns=3, max_tokens=100))
    assert argv == [
        "/x/claude",
        "-p",
        "do it",
        "--output-format",
        "json",
        "--model",
        "policy",
        "--dangerously-skip-permissions",
        "--no-session-persistence",
        "--max-turns",
        "3",
        "--bare",
        "--tools",
        "Bash,Read",
    ]
    argv = ClaudeCodeHarness(tools=["Bash", "Write"]).command("/x/claude", "do it", ep, AgentBudget(max_turns=3))
    assert argv[9:] == [
        "--max-turns",
        "3",
        "--strict-mcp-config",
        "--disable-slash-commands",
        "--setting-sources",
        "user",
        "--tools",
        "Bash,Write",
    ]
    env = h.environment(ep, AgentBudget(max_tokens=100), "/tmp/h")
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"], env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == (
        "http://127.0.0.1:9",
        "sk-1",
        "100",
    )
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["ANTHROPIC_SMALL_FAST_MODEL"] == "policy"


@pytest.fixture(scope="module")
def prepared() -> ClaudeCodeHarness:
    h = ClaudeCodeHarness()
    h.prepare()  # npm, cached under ~/.cache/vime/agents (scripts/install.sh prepares it)
    return h


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vime_core.testing.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)))


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


@pytest.mark.integration
@pytest.mark.parametrize(
    "tools", [("Bash", "Write"), ("Bash", "Read"), DEFAULT_TOOLS], ids=["Bash,Write", "Bash,Read", "default"]
)
def test_requested_tools_reach_the_gateway(prepared, tiny_tokenizer, tools):
    """The tool names of the Messages request Claude Code sends equal ``--agent-claude-code-tools`` exactly, and the
    prompt the gateway renders carries each schema; with Write requested, a scripted Write call writes the file.

    Before the fix ``--bare`` was always passed and its minimal mode offers only Bash, Read and Edit: ``Bash,Write``
    reached the gateway as ``["Bash"]`` and the default four tools as three."""
    import asyncio
    import uuid

    from vime_core.agent.gateway import AgentGateway
    from vime_core.agent.responders import ScriptedResponder

    tok = tiny_tokenizer
    harness = ClaudeCodeHarness(tools=tools, version=prepared.version)
    content = "def f():\n    return 42\n"
    out: dict = {}

    async def body(gw, sid, backend):
        async with LocalSandbox() as sb:
            if "Write" in tools:  # the absolute path is known once the sandbox exists
                backend.script.extend(
                    [call("Write", {"file_path": f"{sb.workspace}/sol.py", "content": content}), "Done."]
                )
            else:
                backend.script.append("Done.")
            addr = await sb.expose_host_port(gw.port)
            out["result"] = await harness.run(
                sb,
                prompt="Write sol.py.",
                budget=AgentBudget(3, 512, 120),
                endpoint=AgentEndpoint(f"http://{addr}", sid, "vime-policy"),
            )
            if "Write" in tools:
                out["file"] = await sb.read_file("sol.py")

    backend = ScriptedResponder(tok, [])
    with AgentGateway(tok, backend, served_model_name="vime-policy") as gw:
        sid = f"sk-tools-{uuid.uuid4().hex[:8]}"
        gw.open_session(sid, sampling_params={"max_tokens": 512}, max_turns=3)
        asyncio.run(body(gw, sid, backend))
        turns = gw.session_turns(sid)
    assert out["result"].status == "completed", out["result"].stderr[-2000:]
    assert [sorted(t.metadata["tools"]) for t in turns] == [sorted(tools)] * len(turns)
    rendered = set(re.findall(r'"function": \{"name": "(\w+)"', turns[0].prompt_text))
    assert rendered == set(tools)
    if "Write" in tools:
        assert len(turns) == 2 and out["file"] == content.encode()
    else:
        assert len(turns) == 1


@pytest.mark.integration
def test_prompt_too_long_is_recognised_by_claude_code(prepared, tiny_tokenizer):
    """A session whose context window (300 tokens) is smaller than Claude Code's first request: the gateway answers
    with the Anthropic API's overflow error, which the real CLI recognises as such (``terminal_reason``
    ``prompt_too_long``, its own "Prompt is too long" message with the token counts it parsed from ours), and the
    episode records that its context ran out."""
    import asyncio
    import uuid

    from vime_core.agent.gateway import AgentGateway
    from vime_core.agent.responders import ScriptedResponder

    harness = ClaudeCodeHarness(tools=["Bash", "Read"], version=prepared.version)
    out: dict = {}

    async def body(gw, sid):
        async with LocalSandbox() as sb:
            addr = await sb.expose_host_port(gw.port)
            out["result"] = await harness.run(
                sb,
                prompt="Say hi.",
                budget=AgentBudget(3, 256, 120),
                endpoint=AgentEndpoint(f"http://{addr}", sid, "vime-policy"),
            )

    backend = ScriptedResponder(tiny_tokenizer, ["Done."])
    with AgentGateway(tiny_tokenizer, backend, served_model_name="vime-policy") as gw:
        sid = f"sk-ctx-{uuid.uuid4().hex[:8]}"
        gw.open_session(sid, max_context_len=300)
        asyncio.run(body(gw, sid))
        overflows = gw._sessions[sid].context_overflows
    r = out["result"]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert (report["terminal_reason"], report["api_error_status"], report["is_error"]) == (
        "prompt_too_long",
        400,
        True,
    )
    assert re.match(r"Prompt is too long · the request is ~\d+ tokens \(limit 299\)", report["result"]), report
    assert (overflows, backend.calls) == (1, [])  # refused before the engine; recorded on the session
