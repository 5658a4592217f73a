"""Prepared agent CLIs in localvm sandboxes: the host's ``~/.cache/vime/agents`` is a read-only 9p share at
``/opt/vime/agents`` in every booted VM (where docker mounts it too), so the harness finds the CLI there and copies
nothing. On the session VM (no extra boot): the share's contents are the host's, it cannot be written, the Claude
Code harness installs from it; then vime's agent-harness contract with the real Claude Code CLI over SSH on that VM
(attach mode: a workspace per sandbox) against the real gateway with a scripted responder."""

from __future__ import annotations

import json
import shlex

import pytest

from vime_core.sandbox.base import SANDBOX_AGENTS_DIR, agents_cache_dir
from vime_core.testing import AgentHarnessContract

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def claude_code():
    harness_mod = pytest.importorskip("vime_agent_claude_code.harness", reason="vime-agent-claude-code not installed")
    h = harness_mod.ClaudeCodeHarness()
    h.prepare(log=lambda *a: None)  # npm once, cached (scripts/ci_services.sh prepares it)
    return h


def test_agents_share_is_the_hosts_read_only(session_vm, claude_code):
    sb, run = session_vm.sandbox, session_vm.run
    host = agents_cache_dir()
    mounts = run(sb.exec(["cat", "/proc/mounts"], timeout=120)).stdout
    line = [m for m in mounts.splitlines() if m.split()[1] == SANDBOX_AGENTS_DIR]
    assert line, (f"no share at {SANDBOX_AGENTS_DIR}: {host} must exist when the session VM boots (`vime agent "
                  "prepare claude-code`; scripts/ci_services.sh does it)")
    assert len(line) == 1 and line[0].split()[2] == "9p" and "ro" in line[0].split()[3].split(","), mounts
    listing = run(sb.exec(f"cd {SANDBOX_AGENTS_DIR} && ls -1", timeout=120)).stdout.split()
    assert listing == sorted(p.name for p in host.iterdir() if not p.name.startswith("."))
    rel = f"{claude_code.NAME}/{claude_code.version}"
    complete = run(sb.exec(["cat", f"{SANDBOX_AGENTS_DIR}/{rel}/.complete"], timeout=120))
    assert complete.stdout == (host / rel / ".complete").read_text()
    size = run(sb.exec(["stat", "-c", "%s", f"{SANDBOX_AGENTS_DIR}/{rel}/{claude_code.EXECUTABLE}"], timeout=120))
    assert int(size.stdout) == (host / rel / claude_code.EXECUTABLE).stat().st_size
    write = run(sb.exec(f"echo x > {SANDBOX_AGENTS_DIR}/{rel}/.complete", timeout=120))
    assert write.exit_code != 0 and "Read-only" in write.stderr, write
    assert (host / rel / ".complete").read_text() == complete.stdout


def test_claude_code_installs_from_the_share(session_vm, claude_code):
    sb, run = session_vm.sandbox, session_vm.run
    run(claude_code.install(sb), timeout=600)
    exe = f"{SANDBOX_AGENTS_DIR}/{claude_code.NAME}/{claude_code.version}/{claude_code.EXECUTABLE}"
    assert claude_code.executable(sb) == exe
    copied = run(sb.exec("ls /tmp/.vime-agents 2>/dev/null | wc -l", timeout=120)).stdout
    assert copied == "0\n", "nothing copied into the VM"
    version = run(sb.exec([exe, "--version"], timeout=600)).stdout
    assert version.split()[0] == claude_code.version, version


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.contract
class TestClaudeCodeOnLocalVM(AgentHarnessContract):
    """The agent-harness contract with the real Claude Code CLI in the session VM (attach mode; the CLI from the 9p
    share), the gateway reached through SSH remote forwarding."""

    EPISODE_WALL_S = 600.0  # the CLI under software emulation starts in tens of seconds

    @pytest.fixture
    def harness(self, claude_code):
        return claude_code

    @pytest.fixture
    def sandbox_factory(self, session_vm, vm_image):
        from vime_sandbox_localvm.sandbox import LocalVMSandbox

        addr = f"root@127.0.0.1:{session_vm.sandbox.port}"
        return lambda **kw: LocalVMSandbox(image_dir=vm_image, ssh=addr, **kw)

    @pytest.fixture
    def write_file_turns(self):
        def turns(path: str, content: str) -> list[str]:
            cmd = f"printf %s {shlex.quote(content)} > {shlex.quote(path)}"
            return [_call("Bash", {"command": cmd, "description": "write the file"}), f"Wrote {path}."]

        return turns

    @pytest.fixture
    def sleep_turns(self):
        return lambda seconds: [_call("Bash", {"command": f"sleep {seconds}", "timeout": 600000})] * 4
