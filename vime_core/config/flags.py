"""How a config section declares its flags: :func:`flag` (one declaration per flag: type, default, help, argparse
options), :func:`ref` (a flag another section declares), :func:`passthrough`, the :class:`Section` and
:class:`PluginConfig` bases, and the flag types and value lists that flags name."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any, ClassVar, Self, TypeVar

# Namespace attributes that are not parser flags but set by parse_run_args: the --vllm-* / --router-* pass-through.
PASSTHROUGH_DESTS = ("vllm_args", "router_args")

#: ``--loss-agg-mode`` values (vime_core/algorithms/options.py applies them)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: ``--lr-decay-style`` values (vime_core/trainer/lr_schedule.py)
DECAY_STYLES = ("constant", "linear", "cosine")
#: ``--target-modules`` value that adapts every linear layer but the output layer (PEFT's shorthand)
ALL_LINEAR = "all-linear"

#: key of a field's metadata holding its argparse options (see :func:`flag`)
FLAG = "vime_flag"
#: key marking a field declared by another section (see :func:`ref`)
REF = "vime_ref"
#: key marking a --vllm-* / --router-* pass-through list (see :func:`passthrough`)
PASSTHROUGH = "vime_passthrough"


class ConfigError(ValueError):
    """A Namespace that lacks flags a config section needs, or a flag declaration that does not fit."""


def json_object(flag_name: str) -> Callable[[str], dict]:
    """An argparse ``type`` that reads a JSON object (``'{"presence_penalty": 0.5}'``), naming ``flag_name``
    otherwise."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag_name}: not valid JSON ({e}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(
                f"{flag_name}: expected a JSON object of vLLM sampling fields, got {text!r}"
            )
        return value

    parse.__name__ = "JSON object"
    return parse


def flag(
    *,
    help: str,  # noqa: A002 - argparse's name
    default: Any = MISSING,
    required: bool = False,
    **argparse_options: Any,
) -> Any:
    """A dataclass field that declares one ``vime run`` flag, ``--<field name with dashes>``.

    :param help: the ``--help`` text (required, non-blank).
    :param default: the default of the field and of the flag; omitted: ``False`` for ``action="store_true"``, else
        ``None``. A list default is copied for each instance.
    :param required: the flag must be given (the field then has no default).
    :param argparse_options: passed to ``add_argument`` as they are (``type``, ``action``, ``choices``, ``nargs``,
        ``metavar``), but ``aliases``: older option strings of the same flag (``("--max-checkpoints",)``), which
        ``--help`` shows and a ``--config`` file's keys may use.
    """
    if not help.strip():
        raise ConfigError("flag(): help must not be blank")
    if default is MISSING and not required:
        default = False if argparse_options.get("action") == "store_true" else None
    options = dict(argparse_options, help=help, required=required)
    if required:
        return field(metadata={FLAG: options})
    options["default"] = default
    if isinstance(default, list | dict | set):
        return field(default_factory=lambda: type(default)(default), metadata={FLAG: options})
    return field(default=default, metadata={FLAG: options})


def ref() -> Any:
    """A dataclass field whose flag another section declares (:func:`flag`): the same value, read under the same
    name; it has no default of its own."""
    return field(metadata={REF: True})


def passthrough() -> Any:
    """A dataclass field holding the ``--vllm-*`` (``vllm_args``) or ``--router-*`` (``router_args``) pass-through
    list that :func:`vime_core.cli.arguments.parse_run_args` splits off the command line."""
    return field(metadata={PASSTHROUGH: True})


def flag_name(f: Field) -> str:
    """The command-line spelling of a declared field: ``--`` and its name with dashes."""
    return "--" + f.name.replace("_", "-")


def declared_flags(cls: type) -> Iterator[Field]:
    """The fields of dataclass ``cls`` that declare a flag (made by :func:`flag`), in declaration order."""
    return (f for f in fields(cls) if FLAG in f.metadata)


def add_flags(group: Any, cls: type, skip: Collection[str] = ()) -> None:
    """Add the flags ``cls`` declares to an argparse parser or argument group (a list default is copied per parser:
    a parsed value never aliases the declaration's), but those whose field name is in ``skip``; a flag's
    ``aliases`` (older names, :func:`flag`) are option strings of the same flag."""
    for f in declared_flags(cls):
        if f.name in skip:
            continue
        options = dict(f.metadata[FLAG])
        aliases = options.pop("aliases", ())
        if isinstance(options.get("default"), list | dict | set):
            options["default"] = copy.copy(options["default"])
        group.add_argument(flag_name(f), *aliases, dest=f.name, **options)


class Section:
    """Base of the config sections: :meth:`from_args` reads each field from the Namespace attribute of its name."""

    __slots__ = ()
    #: the ``--help`` group title and description of the section's flags
    TITLE: ClassVar[str]
    DESCRIPTION: ClassVar[str | None] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """This section's flags read from parsed ``vime run`` arguments.

        :raises ConfigError: naming the missing flags when ``args`` lacks some (a hand-built Namespace; build it
            with :func:`vime_core.cli.arguments.default_args` instead).
        """
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        missing = [n for n in names if not hasattr(args, n)]
        if missing:
            flags = ", ".join(n if n in PASSTHROUGH_DESTS else "--" + n.replace("_", "-") for n in missing)
            raise ConfigError(
                f"{cls.__name__} needs the flags {flags}, which the arguments lack; build the Namespace with "
                "vime_core.cli.arguments.default_args(**overrides) (every flag at its default) or parse_run_args(argv)"
            )
        return cls(**{n: getattr(args, n) for n in names})


P = TypeVar("P", bound="PluginConfig")


class PluginConfig:
    """Base of a plugin's own ``vime run`` flags: a frozen, ``kw_only`` dataclass whose fields are declared with
    :func:`flag` and named ``<PREFIX with underscores>_*`` (flags ``--<PREFIX>-*``).

    A plugin registers the class through ``vime_register_flags`` (``register(PREFIX, cls)``); the registry checks
    the prefix and that every field is a flag with help. Read it with :meth:`from_args` or
    :meth:`RunConfig.plugin`.
    """

    #: flag prefix without dashes, e.g. ``"sandbox-docker"`` for ``--sandbox-docker-*``
    PREFIX: ClassVar[str]
    #: the ``--help`` group title of the flags (e.g. the distribution name)
    TITLE: ClassVar[str]

    @classmethod
    def from_args(cls, args: argparse.Namespace | None) -> Self:
        """The plugin's flags as ``args`` holds them; a flag ``args`` lacks (a hand-built Namespace, or ``None``
        outside ``vime run``) takes its declared default."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if args is not None and hasattr(args, f.name)}  # type: ignore[arg-type]
        return cls(**values)


def check_plugin_config(prefix: str, cls: Any) -> None:
    """Check a plugin's flag class: a frozen :class:`PluginConfig` dataclass, ``PREFIX == prefix``, every field a
    :func:`flag` with help, named under the prefix, each with a default.

    :raises ConfigError: naming the class and what does not fit.
    """
    where = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)!s}"
    if not (isinstance(cls, type) and issubclass(cls, PluginConfig) and is_dataclass(cls)):
        raise ConfigError(f"{where}: a plugin's flags must be a dataclass subclassing vime_core.config.PluginConfig")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ConfigError(f"{where}: a plugin's flag dataclass must be frozen (@dataclass(frozen=True, kw_only=True))")
    if getattr(cls, "PREFIX", None) != prefix:
        raise ConfigError(f"{where}: registered as {prefix!r} but its PREFIX is {getattr(cls, 'PREFIX', None)!r}")
    stem = prefix.replace("-", "_") + "_"
    for f in fields(cls):
        if FLAG not in f.metadata:
            raise ConfigError(f"{where}.{f.name}: every field of a plugin's flag class must be declared with flag()")
        if not f.name.startswith(stem):
            raise ConfigError(f"{where}.{f.name}: the flag {flag_name(f)} is outside the plugin's prefix --{prefix}-")
        if f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ConfigError(f"{where}.{f.name}: a plugin flag needs a default (plugins' flags are optional)")
