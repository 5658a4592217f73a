"""Hook implementations of vime-agent-claude-code (import-light: the harness module loads on use)."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_agent_harnesses(register):
    from vime_agent_claude_code.harness import ClaudeCodeHarness

    register("claude-code", ClaudeCodeHarness)


@hookimpl
def vime_register_flags(register):
    from vime_agent_claude_code.harness import ClaudeCodeFlags

    register(ClaudeCodeFlags.PREFIX, ClaudeCodeFlags)
