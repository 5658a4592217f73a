"""A run's :class:`~vime_core.config.context.PluginContext` and :class:`~vime_core.config.RunConfig` without ``vime
run``, for tests and the contract kit: every flag at its default, overridable by keyword (flag names with underscores),
with the loaded plugins and, where given, the engines a generate function uses."""

from __future__ import annotations

from typing import Any

from vime_core.cli.arguments import build_parser, build_run_config, complete_args, default_args
from vime_core.config import RunConfig
from vime_core.config.context import Engines, PluginContext
from vime_core.plugins.manager import get_plugins


def run_config(**overrides: Any) -> RunConfig:
    """The :class:`RunConfig` of ``vime run`` with every flag at its default, then ``overrides`` (the installed
    plugins' flag classes included)."""
    return build_run_config(default_args(**overrides))


def plugin_context(engines: Engines | None = None, **overrides: Any) -> PluginContext:
    """The :class:`PluginContext` a plugin function gets in a run with every flag at its default, then
    ``overrides`` (e.g. ``plugin_context(reward_key="acc")``), with the loaded plugins and ``engines`` (e.g.
    ``Engines(client, tokenizer)``: what a generate function calls)."""
    return PluginContext(run_config(**overrides), engines=engines, plugins=get_plugins())


def plugin_context_from_argv(argv: list[str]) -> PluginContext:
    """The :class:`PluginContext` of ``vime run argv`` without its combination checks (every flag not on ``argv``
    at its default), e.g. ``plugin_context_from_argv(["--sandbox", "docker", "--sandbox-memory-mb", "256"])``.

    :raises SystemExit: argparse's own error for an unknown flag or a bad value.
    """
    return PluginContext(build_run_config(complete_args(build_parser().parse_args(argv))), plugins=get_plugins())
