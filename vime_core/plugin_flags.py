"""A plugin's own ``vime run`` flags, read without repeating their defaults.

A plugin defines its prefixed flags (``--reward-tests-*``, ``--agent-codex-*``, ``--sandbox-docker-*``) in one
``add_arguments(parser)`` function (what its ``vime_add_arguments`` hook calls) and reads them back with
:func:`own_flags`: the value ``args`` holds, or — when ``args`` lacks the flag (a hand-built, partial Namespace, or
``None`` outside ``vime run``) — the default of the flag's definition. Defaults therefore live in one place, the
flag definition, as for the framework's flags (:mod:`vime_core.config`). The framework's flags are read through a
config section (``SandboxConfig.from_args(args)``), never through this.
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable
from typing import Any

AddArguments = Callable[..., None]


@functools.cache
def flag_defaults(add_arguments: AddArguments) -> dict[str, Any]:
    """``{dest: default}`` of the flags ``add_arguments`` adds to a fresh parser (called as
    ``add_arguments(parser=...)``, the ``vime_add_arguments`` signature); built once per function."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser=parser)
    return {a.dest: a.default for a in parser._actions if a.option_strings}


def own_flags(args: argparse.Namespace | None, add_arguments: AddArguments) -> argparse.Namespace:
    """The flags ``add_arguments`` defines, as a Namespace: each at its value in ``args``, or at its default when
    ``args`` lacks it (or is ``None``). Only those flags: a framework flag is not in it."""
    return argparse.Namespace(
        **{
            dest: getattr(args, dest) if hasattr(args, dest) else copy.deepcopy(default)
            for dest, default in flag_defaults(add_arguments).items()
        }
    )
