"""``CodexHarness``: ``codex exec`` against vime's agent gateway (OpenAI Responses API, streaming).

The npm package ``@openai/codex`` ships a static (musl) native executable (``@openai/codex-linux-x64``), so the
sandbox needs no Node.js: the host prepares it once (``vime agent prepare codex``, npm into
``~/.cache/vime/agents/codex/<version>``) and :class:`~vime_core.agent.harness.NpmAgentHarness` shows or copies it
into the sandbox (with its bundled ``rg`` on ``PATH``).

Each run gets its own ``CODEX_HOME`` under the sandbox's ``/tmp`` holding this ``config.toml``::

    model = "<model>"
    model_provider = "vime"
    approval_policy = "never"                  # run commands without asking
    sandbox_mode = "danger-full-access"        # vime's sandbox is the sandbox (Codex's bwrap/landlock off)
    check_for_update_on_startup = false
    [analytics]
    enabled = false
    [model_providers.vime]
    name = "vime"
    base_url = "<gateway>/v1"
    env_key = "VIME_API_KEY"                   # = the session id
    wire_api = "responses"
    supports_websockets = false
    request_max_retries = 0
    stream_max_retries = 0

and runs ``codex exec --json --skip-git-repo-check --ephemeral -C <cwd> PROMPT``. Codex has no turn limit of its
own: ``budget.max_turns`` is enforced by the gateway session (``open_session(max_turns=...)``), whose refusal
(:data:`~vime_core.agent.gateway.TURN_BUDGET_MESSAGE`) ends the run as ``max_turns``. The JSONL events give the
end: ``turn.completed`` → ``completed``; ``turn.failed``/``error`` or a non-zero exit → ``error``; killed at
``wall_time_s`` → ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from vime_core.agent.gateway import TURN_BUDGET_MESSAGE
from vime_core.agent.harness import AgentBudget, AgentEndpoint, AgentHarnessError, AgentRunResult, NpmAgentHarness
from vime_core.sandbox.base import Sandbox

DEFAULT_VERSION = "0.171.0"  # native (Rust, musl) executable, pinned for reproducible runs


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


class CodexHarness(NpmAgentHarness):
    """The Codex CLI (``codex exec``) in a sandbox, talking only to the gateway.

    :param version: npm version (default :data:`DEFAULT_VERSION`).
    :param config: extra ``-c KEY=VALUE`` overrides (TOML values), e.g. ``['model_reasoning_effort="low"']``.
    :param extra_args: more ``codex exec`` arguments, inserted before the prompt.
    """

    NAME = "codex"
    api = "openai-responses"
    NPM_PACKAGE = "@openai/codex"
    DEFAULT_VERSION = DEFAULT_VERSION
    EXECUTABLE = "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    EXTRA_PATH = ("node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/codex-path",)

    def __init__(
        self, *, version: str | None = None, config: list[str] | None = None, extra_args: list[str] | None = None
    ) -> None:
        super().__init__(version=version)
        self.config = list(config or [])
        self.extra_args = list(extra_args or [])

    @classmethod
    def from_args(cls, args: argparse.Namespace | None) -> CodexHarness:
        """From ``--agent-codex-version`` and ``--agent-codex-config``."""
        if args is None:
            return cls()
        return cls(version=getattr(args, "agent_codex_version", None), config=getattr(args, "agent_codex_config", []))

    def config_toml(self, endpoint: AgentEndpoint) -> str:
        """The ``config.toml`` of one run (see the module docstring)."""
        return "\n".join(
            [
                f"model = {_toml_str(endpoint.model)}",
                'model_provider = "vime"',
                'approval_policy = "never"',
                'sandbox_mode = "danger-full-access"',
                "check_for_update_on_startup = false",
                "",
                "[analytics]",
                "enabled = false",
                "",
                "[model_providers.vime]",
                'name = "vime"',
                f"base_url = {_toml_str(endpoint.base_url.rstrip('/') + '/v1')}",
                'env_key = "VIME_API_KEY"',
                'wire_api = "responses"',
                "supports_websockets = false",
                "request_max_retries = 0",
                "stream_max_retries = 0",
                "",
            ]
        )

    def command(self, exe: str, prompt: str, cwd: str) -> list[str]:
        """The argv of one run."""
        argv = [exe, "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--color", "never", "-C", cwd]
        for c in self.config:
            argv += ["-c", c]
        return argv + self.extra_args + ["--", prompt]

    async def run(
        self, sandbox: Sandbox, *, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, cwd: str | None = None
    ) -> AgentRunResult:
        """Run ``codex exec`` once (see the module docstring).

        :raises AgentHarnessError: the CLI is not installed in the sandbox or could not start.
        """
        await self.install(sandbox)
        home = f"/tmp/.vime-agent/codex-{uuid.uuid4().hex[:12]}"
        try:
            await sandbox.write_file(f"{home}/config.toml", self.config_toml(endpoint))
        except OSError as e:
            raise AgentHarnessError(f"cannot write the Codex configuration into the sandbox: {e}") from e
        workdir = cwd or sandbox.workspace
        argv = self.command(self.executable(sandbox), prompt, workdir)
        path = ":".join([*self.extra_path(sandbox), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
        env = {"CODEX_HOME": home, "VIME_API_KEY": endpoint.api_key, "PATH": path, "NO_COLOR": "1"}
        t0 = time.monotonic()
        r = await sandbox.exec(argv, timeout=budget.wall_time_s, env=env, cwd=workdir)
        duration = time.monotonic() - t0
        events = _events(r.stdout)
        types = [e.get("type") for e in events]
        final = next((e["item"].get("text", "") for e in reversed(events)
                      if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"), "")
        errors = [str(e.get("message") or e.get("error") or "") for e in events
                  if e.get("type") in ("error", "turn.failed")]
        meta: dict[str, Any] = {"events": len(events), "errors": errors[-5:],
                                "commands": sum(1 for e in events if e.get("type") == "item.completed"
                                                and e.get("item", {}).get("type") == "command_execution")}
        if r.timed_out:
            status = "timeout"
        elif not events:
            if r.exit_code == 127 or "not found" in r.stderr[-300:]:
                raise AgentHarnessError(f"codex did not start (exit {r.exit_code}): {r.stderr[-500:]}")
            status = "error"
        elif TURN_BUDGET_MESSAGE in r.stdout or TURN_BUDGET_MESSAGE in r.stderr:
            status = "max_turns"
        elif "turn.completed" in types and r.exit_code == 0 and "turn.failed" not in types:
            status = "completed"
        else:
            status = "error"
        return AgentRunResult(status, r.exit_code, duration, final, r.stdout, r.stderr, meta)


def _events(stdout: str) -> list[dict[str, Any]]:
    """The JSONL events of ``codex exec --json``."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out
