"""Name → implementation registries, filled by the ``vime_register_*`` hooks.

One :class:`Registry` per plugin kind. Names are resolved here and nowhere else: a duplicate name fails naming
both providers, an unknown name lists what is available (and which ``pip install vime-…`` would provide it), and a
dotted ``pkg.mod:obj`` is accepted wherever a name is (slime's escape hatch), through the same checks.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Which distribution provides a name that is not built in (for the "pip install" hint).
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("sandbox", "docker"): "vime-sandbox-docker",
    ("sandbox", "e2b"): "vime-sandbox-e2b",
    ("sandbox", "modal"): "vime-sandbox-modal",
    ("sandbox", "localvm"): "vime-sandbox-localvm",
    ("agent", "claude-code"): "vime-agent-claude-code",
    ("agent", "codex"): "vime-agent-codex",
    ("reward", "tests"): "vime-reward-tests",
}


class RegistryError(ValueError):
    """A name could not be registered or resolved; the message says what to do."""


@dataclass(frozen=True)
class Entry:
    """A registered implementation and where it came from."""

    name: str
    obj: Any
    provider: str  # plugin name as registered with pluggy
    distribution: str  # "vime 0.1.0", "vime-sandbox-docker 0.1.0", or "dotted path"


class Registry:
    """Names of one plugin kind (``generate``, ``reward``, ``sandbox``, …).

    :param kind: the kind, used in messages and the ``pip install`` hint.
    :param flag: the command-line flag that selects a name (for messages).
    :param check: optional ``check(name, obj)`` raising :class:`RegistryError` if ``obj`` does not fit the kind.
    """

    def __init__(self, kind: str, flag: str, check: Callable[[str, Any], None] | None = None) -> None:
        self.kind = kind
        self.flag = flag
        self._check = check
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, obj: Any, provider: str, distribution: str) -> None:
        """Register ``obj`` under ``name``.

        :raises RegistryError: if ``name`` is already taken (naming both providers) or ``obj`` fails the check.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} registered by {provider} ({distribution}) has an invalid name {name!r}")
        if name in self._entries:
            old = self._entries[name]
            raise RegistryError(
                f"duplicate {self.kind} name {name!r}: provided by plugin {old.provider!r} ({old.distribution}) "
                f"and by plugin {provider!r} ({distribution}); uninstall one or block it with VIME_DISABLE_PLUGINS"
            )
        if self._check is not None:
            self._check(name, obj)
        self._entries[name] = Entry(name, obj, provider, distribution)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        """Registered entries, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> Any:
        """Resolve a registered name or a dotted ``pkg.mod:obj`` / ``pkg.mod.obj`` path.

        :raises RegistryError: unknown name (listing the available ones), or a dotted path that does not import.
        """
        if name in self._entries:
            return self._entries[name].obj
        if ":" in name or "." in name:
            obj = _load_dotted(name, self.flag)
            if self._check is not None:
                self._check(name, obj)
            return obj
        hint = KNOWN_PROVIDERS.get((self.kind, name))
        msg = f"unknown {self.kind} {name!r} for {self.flag}; available: {', '.join(self.names()) or '(none)'}"
        if hint:
            msg += f". {name!r} is provided by the {hint} distribution: pip install {hint}"
        else:
            msg += ". A dotted path 'package.module:object' is accepted too"
        raise RegistryError(msg)


def _load_dotted(path: str, flag: str) -> Any:
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise RegistryError(f"{flag} {path!r}: cannot import module {mod_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise RegistryError(f"{flag} {path!r}: module {mod_name!r} has no attribute {attr!r}") from e


def check_callable_signature(*params: str, is_async: bool | None = None) -> Callable[[str, Any], None]:
    """A registry check: ``obj`` is callable, its first positional parameters are ``params``, and (optionally) it
    is (or is not) a coroutine function."""

    def check(name: str, obj: Any) -> None:
        if not callable(obj):
            raise RegistryError(f"{name!r} must be callable, got {type(obj).__name__}")
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return
        got = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(got) < len(params):
            raise RegistryError(f"{name!r} must take parameters ({', '.join(params)}); it takes ({', '.join(got)})")
        if is_async is not None and inspect.iscoroutinefunction(obj) != is_async:
            raise RegistryError(f"{name!r} must {'be' if is_async else 'not be'} an async function")

    return check


def check_subclass(base: type) -> Callable[[str, Any], None]:
    """A registry check: ``obj`` is a subclass of ``base``."""

    def check(name: str, obj: Any) -> None:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise RegistryError(f"{name!r} must be a subclass of {base.__module__}.{base.__qualname__}, got {obj!r}")

    return check
