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

and runs ``codex exec --json --skip-git-repo-check --ephemeral -C <cwd> PROMPT``.

**Compact mode** (``compact=True``, ``--agent-codex-compact``; for small-context policies): Codex's first request is
≈6.7k SmolLM2 tokens by default (base instructions ≈3.8k, 7 tool schemas ≈1.9k, bundled-skills list ≈0.6k; measured
with ``bench/codex_prompt_tokens.py``). Compact mode adds :data:`COMPACT_CONFIG` to ``config.toml`` — only settings
that change the request (each one measured) — and replaces the base instructions with :data:`COMPACT_INSTRUCTIONS`
(written to ``$CODEX_HOME/instructions.md``, ``model_instructions_file``): the first request is then ≈1.1k tokens,
with the two shell tools ``exec_command``/``write_stdin`` (run commands, write files through the shell) and the
``<environment_context>`` (working directory) kept. ``instructions`` (``--agent-codex-instructions-file``) replaces
the base instructions with a text of one's own, with or without compact mode. ``--agent-codex-config`` overrides
are ``-c`` flags and win over both. Codex has no turn limit of its
own: ``budget.max_turns`` is enforced by the gateway session (``open_session(max_turns=...)``), whose refusal
(:data:`~vime_core.agent.gateway.TURN_BUDGET_MESSAGE`) ends the run as ``max_turns``. The JSONL events give the
end: ``turn.completed`` → ``completed``; ``turn.failed``/``error`` or a non-zero exit → ``error``; killed at
``wall_time_s`` → ``timeout``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
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

DEFAULT_VERSION = "0.171.0"  # native (Rust, musl) executable, pinned for reproducible runs

#: ``config.toml`` lines of compact mode, each with the SmolLM2 tokens it removes from the first request (Codex
#: 0.171.0, HumanEval/0, with all the others applied; ``bench/codex_prompt_tokens.py``). Settings that removed nothing
#: (``include_apps_instructions``, ``include_collaboration_mode_instructions``, ``tools.update_plan``, memories) are
#: left out. The project docs (``AGENTS.md``, ``project_doc_max_bytes``) are the task's and stay as they are.
COMPACT_CONFIG: tuple[str, ...] = (
    "include_permissions_instructions = false",  # ≈90: the sandbox/approval policy text (vime's sandbox decides)
    'web_search = "disabled"',  # the web_search tool (the gateway does not render it; the sandbox has no network)
    "include_environment_context_time = false",  # ≈20: date and timezone (the prompt is the same every day)
    "[skills]",
    "include_instructions = false",  # ≈510-590: the <skills_instructions> list
    "bundled.enabled = false",  # ... and the bundled system skills (imagegen, openai-docs, ...) behind it
    "[agents]",
    "enabled = false",  # the multi_agent namespace of sub-agent tools (not rendered, 11k chars of the body)
    "[tools]",
    "experimental_request_user_input.enabled = false",  # ≈355: request_user_input (nobody answers in `exec`)
    "[features]",
    "goals = false",  # ≈725: get_goal/create_goal/update_goal
    "view_image = false",  # ≈93: view_image
)

#: the base instructions of compact mode (≈25 tokens instead of ≈3.8k)
COMPACT_INSTRUCTIONS = (
    "You are a coding agent working in the current directory. Run shell commands with the exec_command tool: read "
    "files with `cat`, write a file with `cat > FILE <<'EOF'` ... `EOF`, run Python with `python3`. Do what the task "
    "asks, then reply with a one-line summary and stop.\n"
)


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


@dataclass(frozen=True, kw_only=True)
class CodexFlags(PluginConfig):
    """The ``--agent-codex-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "agent-codex"
    TITLE = "vime-agent-codex"

    agent_codex_version: str = flag(
        default=DEFAULT_VERSION, help="npm version of @openai/codex (prepared with `vime agent prepare codex`)"
    )
    agent_codex_config: list[str] = flag(
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra `codex -c KEY=VALUE` overrides (TOML values), repeatable (win over the flags below)",
    )
    agent_codex_compact: bool = flag(
        action="store_true",
        default=False,
        help="small-context policies: Codex's first request shrinks from ~6.7k to ~1.1k tokens (short base "
        "instructions; no skills list, permissions text, goal/view_image/request_user_input/sub-agent/"
        "web_search tools; the shell tools exec_command/write_stdin stay). See the plugin README",
    )
    agent_codex_instructions_file: str | None = flag(
        default=None,
        metavar="PATH",
        help="a text file replacing Codex's base instructions (model_instructions_file); with or "
        "without --agent-codex-compact",
    )


class CodexHarness(NpmAgentHarness):
    """The Codex CLI (``codex exec``) in a sandbox, talking only to the gateway.

    :param version: npm version (default :data:`DEFAULT_VERSION`).
    :param config: extra ``-c KEY=VALUE`` overrides (TOML values), e.g. ``['model_reasoning_effort="low"']``.
    :param extra_args: more ``codex exec`` arguments, inserted before the prompt.
    :param compact: compact mode (see the module docstring): :data:`COMPACT_CONFIG` and, unless ``instructions`` is
        given, :data:`COMPACT_INSTRUCTIONS`.
    :param instructions: text replacing Codex's base instructions (``model_instructions_file``).
    """

    NAME = "codex"
    api = "openai-responses"
    FLAGS = CodexFlags
    NPM_PACKAGE = "@openai/codex"
    DEFAULT_VERSION = DEFAULT_VERSION
    EXECUTABLE = "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    EXTRA_PATH = ("node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/codex-path",)

    def __init__(
        self,
        *,
        version: str | None = None,
        config: list[str] | None = None,
        extra_args: list[str] | None = None,
        compact: bool = False,
        instructions: str | None = None,
    ) -> None:
        super().__init__(version=version)
        self.config = list(config or [])
        self.extra_args = list(extra_args or [])
        self.compact = compact
        self.instructions = instructions

    @classmethod
    def from_config(cls, flags: CodexFlags | None = None) -> CodexHarness:
        """From ``--agent-codex-version``, ``--agent-codex-config``, ``--agent-codex-compact`` and
        ``--agent-codex-instructions-file`` of ``flags`` (``None``: the defaults).

        :raises AgentHarnessError: the instructions file cannot be read (the message names the flag).
        """
        own = flags if flags is not None else CodexFlags()
        path = own.agent_codex_instructions_file
        instructions = None
        if path:
            try:
                instructions = Path(path).read_text()
            except OSError as e:
                raise AgentHarnessError(f"--agent-codex-instructions-file {path}: {e}") from e
        return cls(
            version=own.agent_codex_version,
            config=own.agent_codex_config or [],
            compact=bool(own.agent_codex_compact),
            instructions=instructions,
        )

    def instructions_text(self) -> str | None:
        """The text replacing Codex's base instructions, or ``None`` (Codex's own)."""
        if self.instructions is not None:
            return self.instructions
        return COMPACT_INSTRUCTIONS if self.compact else None

    def home_files(self, endpoint: AgentEndpoint, home: str) -> dict[str, str]:
        """The files of one run's ``CODEX_HOME`` (absolute path in the sandbox → text): ``config.toml``, and
        ``instructions.md`` when the base instructions are replaced."""
        files = {f"{home}/config.toml": self.config_toml(endpoint, home)}
        text = self.instructions_text()
        if text is not None:
            files[f"{home}/instructions.md"] = text
        return files

    def config_toml(self, endpoint: AgentEndpoint, home: str = "/tmp/.vime-agent/codex") -> str:
        """The ``config.toml`` of one run whose ``CODEX_HOME`` is ``home`` (see the module docstring)."""
        top = [f"model_instructions_file = {_toml_str(home + '/instructions.md')}"]
        if self.instructions_text() is None:
            top = []
        tables: list[str] = []
        if self.compact:
            i = COMPACT_CONFIG.index("[skills]")
            top += list(COMPACT_CONFIG[:i])
            for line in COMPACT_CONFIG[i:]:
                tables += ["", line] if line.startswith("[") else [line]
        return "\n".join(
            [
                *top,
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
                *tables,
                "",
            ]
        )

    def command(self, exe: str, prompt: str, cwd: str) -> list[str]:
        """The argv of one run."""
        argv = [exe, "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--color", "never", "-C", cwd]
        for c in self.config:
            argv += ["-c", c]
        return argv + self.extra_args + ["--", prompt]

    async def prepare_home(self, sandbox: Sandbox, endpoint: AgentEndpoint, home: str) -> None:
        """Write :meth:`home_files` into the sandbox.

        :raises AgentHarnessError: they cannot be written.
        """
        try:
            for path, text in self.home_files(endpoint, home).items():
                await sandbox.write_file(path, text)
        except OSError as e:
            raise AgentHarnessError(f"cannot write the Codex configuration into the sandbox: {e}") from e

    def launch(
        self, sandbox: Sandbox, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, home: str, cwd: str | None
    ) -> tuple[list[str], dict[str, str], str | None]:
        """:meth:`command` in ``cwd`` (``None``: the sandbox workspace) with ``CODEX_HOME``, the session id as
        ``VIME_API_KEY``, :attr:`EXTRA_PATH` on ``PATH`` and ``NO_COLOR``."""
        workdir = cwd or sandbox.workspace
        argv = self.command(self.executable(sandbox), prompt, workdir)
        path = ":".join([*self.extra_path(sandbox), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
        env = {"CODEX_HOME": home, "VIME_API_KEY": endpoint.api_key, "PATH": path, "NO_COLOR": "1"}
        return argv, env, workdir

    def read_output(self, r: ExecResult, argv: list[str]) -> tuple[list[dict[str, Any]] | None, str, dict[str, Any]]:
        """The JSONL events of ``codex exec --json`` (``None`` if none), the last agent message and the metadata:
        event count, the last five errors, the number of commands run."""
        events = json_lines(r.stdout)
        final = next(
            (
                e["item"].get("text", "")
                for e in reversed(events)
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"
            ),
            "",
        )
        errors = [
            str(e.get("message") or e.get("error") or "") for e in events if e.get("type") in ("error", "turn.failed")
        ]
        meta: dict[str, Any] = {
            "events": len(events),
            "errors": errors[-5:],
            "commands": sum(
                1
                for e in events
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "command_execution"
            ),
        }
        return (events or None), final, meta

    def end_status(self, r: ExecResult, output: list[dict[str, Any]]) -> AgentEndStatus:
        """The gateway's turn-budget refusal → ``max_turns``; ``turn.completed`` without ``turn.failed`` and exit 0
        → ``completed``; else ``error``."""
        types = [e.get("type") for e in output]
        if TURN_BUDGET_MESSAGE in r.stdout or TURN_BUDGET_MESSAGE in r.stderr:
            return "max_turns"
        if "turn.completed" in types and r.exit_code == 0 and "turn.failed" not in types:
            return "completed"
        return "error"
