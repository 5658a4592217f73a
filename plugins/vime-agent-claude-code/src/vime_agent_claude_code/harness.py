"""``ClaudeCodeHarness``: Claude Code in print mode (``claude -p``) against vime's agent gateway.

The npm package ``@anthropic-ai/claude-code`` ships a native executable (``@anthropic-ai/claude-code-linux-x64``),
so the sandbox needs no Node.js: the host prepares it once (``vime agent prepare claude-code``, npm into
``~/.cache/vime/agents/claude-code/<version>``) and :class:`~vime_core.agent.harness.NpmAgentHarness` shows or copies
it into the sandbox.

One run is::

    claude -p PROMPT --output-format json --model MODEL --max-turns N --dangerously-skip-permissions
           --no-session-persistence --tools Bash,Read,Write,Edit
           (--bare | --strict-mcp-config --disable-slash-commands --setting-sources user)

``--bare`` (minimal mode) only when every requested tool is one it offers (:data:`BARE_TOOLS`: Bash, Read, Edit);
otherwise the full mode with the flags in parentheses, so that ``--tools`` is honoured exactly.

with ``ANTHROPIC_BASE_URL=<gateway>``, ``ANTHROPIC_API_KEY=<session id>`` (``--bare`` reads only that key),
``ANTHROPIC_MODEL``/``ANTHROPIC_SMALL_FAST_MODEL``/``ANTHROPIC_DEFAULT_*_MODEL`` = the gateway's model (any
background call goes to the policy too), ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``,
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_TELEMETRY``, ``DISABLE_ERROR_REPORTING``,
``DISABLE_AUTOUPDATER``, ``CLAUDE_CODE_DISABLE_AUTO_MEMORY``, ``IS_SANDBOX=1`` (Claude Code refuses
``--dangerously-skip-permissions`` as root otherwise) and ``CLAUDE_CONFIG_DIR``/``HOME`` in a per-run directory under
the sandbox's ``/tmp`` (so nothing of Claude Code's lands in the workspace). The JSON result's ``subtype`` gives the
end: ``success`` → ``completed``, ``error_max_turns`` → ``max_turns``; ``is_error`` or a non-zero exit → ``error``;
killed at ``wall_time_s`` → ``timeout``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from vime_core.agent.harness import (
    AgentBudget,
    AgentEndpoint,
    AgentEndStatus,
    AgentHarnessError,
    NpmAgentHarness,
    json_lines,
)
from vime_core.agent.session import TURN_BUDGET_MESSAGE
from vime_core.config import PluginConfig, flag
from vime_core.sandbox.base import ExecResult, Sandbox

DEFAULT_VERSION = "2.1.197"  # what npm picks on Node 20; native executable, pinned for reproducible runs
DEFAULT_TOOLS = ("Bash", "Read", "Write", "Edit")
#: The only built-in tools Claude Code 2.1.197 offers in its minimal mode: ``--bare`` sets ``CLAUDE_CODE_SIMPLE=1``,
#: whose tool pool is hard-wired to Bash, Read and Edit; ``--tools`` can only narrow that pool, so e.g.
#: ``--tools Bash,Write`` under ``--bare`` sends the model Bash alone (checked by printing the Messages request's
#: ``tools``; see the plugin README).
BARE_TOOLS = frozenset({"Bash", "Read", "Edit"})
#: What replaces ``--bare``'s isolation when a tool outside :data:`BARE_TOOLS` needs the full mode: no MCP servers
#: but ours (none), no skills/slash commands, settings from the per-run ``HOME`` only (not the workspace's
#: ``.claude/``); plus ``CLAUDE_CODE_DISABLE_AUTO_MEMORY=1`` in the environment.
FULL_MODE_ARGS = ("--strict-mcp-config", "--disable-slash-commands", "--setting-sources", "user")


@dataclass(frozen=True, kw_only=True)
class ClaudeCodeFlags(PluginConfig):
    """The ``--agent-claude-code-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "agent-claude-code"
    TITLE = "vime-agent-claude-code"

    agent_claude_code_version: str = flag(
        default=DEFAULT_VERSION,
        help="npm version of @anthropic-ai/claude-code (prepared with `vime agent prepare claude-code`)",
    )
    agent_claude_code_tools: str = flag(
        default=",".join(DEFAULT_TOOLS),
        help="comma-separated built-in tools offered to the model ('' = Claude Code's full default set)",
    )
    agent_claude_code_system_prompt: str | None = flag(
        default=None, help="replace Claude Code's system prompt (shorter prompts for small context windows)"
    )
    agent_claude_code_no_bare: bool = flag(
        action="store_true", help="do not pass --bare (let Claude Code read CLAUDE.md, hooks, skills of the workspace)"
    )


class ClaudeCodeHarness(NpmAgentHarness):
    """Claude Code (``claude -p``) in a sandbox, talking only to the gateway (Anthropic Messages API, streaming).

    :param version: npm version (default :data:`DEFAULT_VERSION`).
    :param tools: built-in tools offered to the model (``--tools``); empty: Claude Code's default set (two dozen
        tools, ~64 KB of schemas).
    :param system_prompt: replaces Claude Code's system prompt (``--system-prompt``) when given.
    :param bare: pass ``--bare`` (no hooks, plugins, CLAUDE.md discovery, background prefetches). ``None``
        (default): exactly when every tool in ``tools`` is in :data:`BARE_TOOLS` (minimal mode cannot offer any
        other tool); otherwise the full mode with :data:`FULL_MODE_ARGS`.
    :param extra_args: more CLI arguments, appended.
    """

    NAME = "claude-code"
    api = "anthropic"
    FLAGS = ClaudeCodeFlags
    NPM_PACKAGE = "@anthropic-ai/claude-code"
    DEFAULT_VERSION = DEFAULT_VERSION
    EXECUTABLE = "node_modules/@anthropic-ai/claude-code-linux-x64/claude"

    def __init__(
        self,
        *,
        version: str | None = None,
        tools: tuple[str, ...] | list[str] | None = DEFAULT_TOOLS,
        system_prompt: str | None = None,
        bare: bool | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        """:raises ValueError: ``bare=True`` with a tool (or the full default set, ``tools`` empty) that Claude Code's
        minimal mode does not offer."""
        super().__init__(version=version)
        self.tools = list(tools or [])
        self.system_prompt = system_prompt
        fits_bare = bool(self.tools) and set(self.tools) <= BARE_TOOLS
        if bare and not fits_bare:
            outside = sorted(set(self.tools) - BARE_TOOLS) or ["(the full default set)"]
            raise ValueError(
                f"claude-code: --bare (minimal mode) offers only {', '.join(sorted(BARE_TOOLS))}; "
                f"--agent-claude-code-tools asks for {', '.join(outside)} as well: drop bare=True (the default picks "
                "the full mode for such tool sets) or narrow the tools"
            )
        self.bare = fits_bare if bare is None else bool(bare)
        self.extra_args = list(extra_args or [])

    @classmethod
    def from_config(cls, flags: ClaudeCodeFlags | None = None) -> ClaudeCodeHarness:
        """From ``--agent-claude-code-version``, ``-tools``, ``-system-prompt``, ``-no-bare`` of ``flags``
        (``None``: the defaults; without ``-no-bare``, ``bare`` is chosen from the tools)."""
        own = flags if flags is not None else ClaudeCodeFlags()
        return cls(
            version=own.agent_claude_code_version,
            tools=[t for t in (own.agent_claude_code_tools or "").split(",") if t],
            system_prompt=own.agent_claude_code_system_prompt,
            bare=False if own.agent_claude_code_no_bare else None,
        )

    def command(self, exe: str, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget) -> list[str]:
        """The argv of one run."""
        argv = [
            exe,
            "-p",
            prompt,
            "--output-format",
            "json",
            "--model",
            endpoint.model,
            "--dangerously-skip-permissions",
            "--no-session-persistence",
        ]
        if budget.max_turns is not None:
            argv += ["--max-turns", str(int(budget.max_turns))]
        if self.bare:
            argv.append("--bare")
        else:
            argv += list(FULL_MODE_ARGS)
        if self.tools:
            argv += ["--tools", ",".join(self.tools)]
        if self.system_prompt is not None:
            argv += ["--system-prompt", self.system_prompt]
        return argv + self.extra_args

    def environment(self, endpoint: AgentEndpoint, budget: AgentBudget, home: str) -> dict[str, str]:
        """The environment of one run (see the module docstring)."""
        m = endpoint.model
        return {
            "ANTHROPIC_BASE_URL": endpoint.base_url,
            "ANTHROPIC_API_KEY": endpoint.api_key,
            "ANTHROPIC_MODEL": m,
            "ANTHROPIC_SMALL_FAST_MODEL": m,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": m,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": m,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": m,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(int(budget.max_tokens)),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1",
            "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
            "CLAUDE_CONFIG_DIR": f"{home}/claude",
            "HOME": home,
        }

    async def prepare_home(self, sandbox: Sandbox, endpoint: AgentEndpoint, home: str) -> None:
        """Create ``home/claude`` (``CLAUDE_CONFIG_DIR``).

        :raises AgentHarnessError: it cannot be created.
        """
        mk = await sandbox.exec(["mkdir", "-p", f"{home}/claude"], timeout=60)
        if mk.exit_code != 0:
            raise AgentHarnessError(f"cannot create {home} in the sandbox: {mk.stderr[-300:]}")

    def launch(
        self, sandbox: Sandbox, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, home: str, cwd: str | None
    ) -> tuple[list[str], dict[str, str], str | None]:
        """:meth:`command` and :meth:`environment`, in ``cwd`` (``None``: the sandbox's default)."""
        argv = self.command(self.executable(sandbox), prompt, endpoint, budget)
        return argv, self.environment(endpoint, budget, home), cwd

    def read_output(self, r: ExecResult, argv: list[str]) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
        """The result object (``--output-format json`` prints one), its ``result`` text and the metadata: the
        command (prompt left out) and the result's ``subtype``, ``num_turns``, ``is_error``, ``stop_reason``,
        ``api_error_status``, ``session_id``."""
        objects = json_lines(r.stdout)
        result = objects[-1] if objects else None
        meta: dict[str, Any] = {"command": shlex.join(argv[:1] + ["-p", "<prompt>"] + argv[3:])}
        if result is not None:
            meta.update(
                {
                    k: result.get(k)
                    for k in ("subtype", "num_turns", "is_error", "stop_reason", "api_error_status", "session_id")
                    if k in result
                }
            )
        final = str(result.get("result", "")) if result else ""
        return result, final, meta

    def end_status(self, r: ExecResult, output: dict[str, Any]) -> AgentEndStatus:
        """``error_max_turns`` (or the gateway's turn-budget refusal) → ``max_turns``; ``is_error`` or a non-zero
        exit → ``error``; else ``completed``."""
        if output.get("subtype") == "error_max_turns" or TURN_BUDGET_MESSAGE in str(output.get("result", "")):
            return "max_turns"
        if output.get("is_error") or r.exit_code != 0:
            return "error"
        return "completed"
