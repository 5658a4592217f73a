"""Contract of a plugin's command-line flags (``vime_add_arguments``)."""

from __future__ import annotations

import argparse

from vime_core.arguments import flags_without_help
from vime_core.testing.contracts.base import _Contract


class PluginArgumentsContract(_Contract):
    """A plugin's ``vime_add_arguments`` flags: every flag has a help string (what it does, its unit, which other
    flag it interacts with; ``--help`` appends the default), and adding them to a fresh parser works.

    Fixture: ``add_arguments`` — the plugin's ``vime_add_arguments`` hook implementation (called as
    ``add_arguments(parser)``).
    """

    def _parser(self, add_arguments) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="vime run", allow_abbrev=False)
        add_arguments(parser)
        return parser

    def test_adds_flags(self, add_arguments) -> None:
        """The hook adds at least one flag (a plugin without flags needs no ``vime_add_arguments``)."""
        assert [a for a in self._parser(add_arguments)._actions if a.option_strings and a.dest != "help"]

    def test_every_flag_has_help(self, add_arguments) -> None:
        """No flag without a help string (``vime run --help`` and ``vime args`` print it)."""
        assert flags_without_help(self._parser(add_arguments)) == []

    def test_defaults_parse(self, add_arguments) -> None:
        """Parsing no flags gives every flag its default (no required plugin flag: a run without the plugin's
        component must not need it)."""
        parser = self._parser(add_arguments)
        args = parser.parse_args([])
        for a in parser._actions:
            if a.option_strings and a.dest != "help":
                assert getattr(args, a.dest) == a.default, a.option_strings[0]
