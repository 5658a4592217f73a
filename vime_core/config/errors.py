"""The error of a bad ``vime run`` flag or value (raised by the parser, the YAML config loading and the checks)."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad flag or value; the message names it and says what was expected."""
