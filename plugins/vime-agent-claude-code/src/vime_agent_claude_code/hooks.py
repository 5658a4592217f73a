"""Hook implementations of vime-agent-claude-code (import-light: the harness module loads on use)."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_agent_harnesses(register):
    from vime_agent_claude_code.harness import ClaudeCodeHarness

    register("claude-code", ClaudeCodeHarness)


@hookimpl
def vime_add_arguments(parser):
    from vime_agent_claude_code.harness import DEFAULT_TOOLS, DEFAULT_VERSION

    g = parser.add_argument_group("vime-agent-claude-code")
    g.add_argument("--agent-claude-code-version", default=DEFAULT_VERSION,
                   help="npm version of @anthropic-ai/claude-code (prepared with `vime agent prepare claude-code`)")
    g.add_argument("--agent-claude-code-tools", default=",".join(DEFAULT_TOOLS),
                   help="comma-separated built-in tools offered to the model ('' = Claude Code's full default set)")
    g.add_argument("--agent-claude-code-system-prompt", default=None,
                   help="replace Claude Code's system prompt (shorter prompts for small context windows)")
    g.add_argument("--agent-claude-code-no-bare", action="store_true",
                   help="do not pass --bare (let Claude Code read CLAUDE.md, hooks, skills of the workspace)")
