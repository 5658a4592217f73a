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
    g.add_argument(
        "--agent-codex-version",
        default=DEFAULT_VERSION,
        help="npm version of @openai/codex (prepared with `vime agent prepare codex`)",
    )
    g.add_argument(
        "--agent-codex-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra `codex -c KEY=VALUE` overrides (TOML values), repeatable (win over the flags below)",
    )
    g.add_argument(
        "--agent-codex-compact",
        action="store_true",
        default=False,
        help="small-context policies: Codex's first request shrinks from ~6.7k to ~1.1k tokens (short base "
        "instructions; no skills list, permissions text, goal/view_image/request_user_input/sub-agent/"
        "web_search tools; the shell tools exec_command/write_stdin stay). See the plugin README",
    )
    g.add_argument(
        "--agent-codex-instructions-file",
        default=None,
        metavar="PATH",
        help="a text file replacing Codex's base instructions (model_instructions_file); with or "
        "without --agent-codex-compact",
    )
