"""Hook implementations of vime-agent-codex (import-light: the harness module loads on use)."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_agent_harnesses(register):
    from vime_agent_codex.harness import CodexHarness

    register("codex", CodexHarness)


@hookimpl
def vime_register_flags(register):
    from vime_agent_codex.harness import CodexFlags

    register(CodexFlags.PREFIX, CodexFlags)
