"""Hook implementations of vime-agent-codex (import-light: the harness module loads on use)."""

from __future__ import annotations

from vime_core import hookimpl


@hookimpl
def vime_register_agent_harnesses(register):
    from vime_agent_codex.harness import CodexHarness

    register("codex", CodexHarness)


@hookimpl
def vime_add_arguments(parser):
    from vime_agent_codex.harness import DEFAULT_VERSION

    g = parser.add_argument_group("vime-agent-codex")
    g.add_argument("--agent-codex-version", default=DEFAULT_VERSION,
                   help="npm version of @openai/codex (prepared with `vime agent prepare codex`)")
    g.add_argument("--agent-codex-config", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `codex -c KEY=VALUE` overrides (TOML values), repeatable")
