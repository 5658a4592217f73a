"""Contract of a plugin's command-line flags: its :class:`~vime_core.config.PluginConfig` class
(``vime_register_flags``), or the deprecated ``vime_add_arguments`` hook."""

from __future__ import annotations

import argparse
from dataclasses import fields

from vime_core.cli.arguments import flags_without_help
from vime_core.config import PluginConfig, add_flags, check_plugin_config
from vime_core.testing.contracts.base import _Contract


def flags_parser(*classes: type) -> argparse.ArgumentParser:
    """A bare parser holding only the flags that ``classes`` (config sections or plugin flag classes) declare: what a
    test parses a plugin's flags with, without the rest of ``vime run``."""
    parser = argparse.ArgumentParser(prog="vime run", allow_abbrev=False)
    for cls in classes:
        add_flags(parser, cls)
    return parser


class PluginFlagsContract(_Contract):
    """A plugin's flag class: a frozen :class:`~vime_core.config.PluginConfig` dataclass the registry accepts
    (every field a ``flag()`` under ``--<PREFIX>-``, with help and a default), whose flags parse, with no flag given,
    to exactly the class's defaults.

    Fixture: ``flags_class`` — the class the plugin's ``vime_register_flags`` registers.
    """

    def test_the_registry_accepts_it(self, flags_class) -> None:
        """:func:`vime_core.config.check_plugin_config` passes (the check ``vime_register_flags`` runs)."""
        assert issubclass(flags_class, PluginConfig)
        check_plugin_config(flags_class.PREFIX, flags_class)
        assert [f.name for f in fields(flags_class)], "a plugin without flags needs no vime_register_flags"

    def test_every_flag_has_help(self, flags_class) -> None:
        """No flag without a help string (``vime run --help`` and ``vime args`` print it)."""
        assert flags_without_help(flags_parser(flags_class)) == []

    def test_defaults_parse_to_the_class_defaults(self, flags_class) -> None:
        """Parsing no flags gives the class's defaults (no required plugin flag: a run without the plugin's
        component must not need it), and outside ``vime run`` (``args`` ``None``) the same."""
        args = flags_parser(flags_class).parse_args([])
        assert flags_class.from_args(args) == flags_class() == flags_class.from_args(None)


class PluginArgumentsContract(_Contract):
    """Deprecated (``vime_add_arguments``; use :class:`PluginFlagsContract`): a plugin's hand-added flags have help
    strings, and adding them to a fresh parser works.

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
