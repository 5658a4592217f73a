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
from typing import Any, Generic, TypeVar

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


#: what one registry holds: a :mod:`vime_core.plugins.protocols` callable or a ``type`` of a base class
T = TypeVar("T")


class RegistryError(ValueError):
    """A name could not be registered or resolved; the message says what to do."""


@dataclass(frozen=True)
class Lazy:
    """An implementation registered by its import path ``"pkg.module:object"``: the name is known (listed, checked)
    at once, the module is imported only when the name is resolved (:meth:`Registry.get`), where the registry's
    checks run. Built-ins whose modules import torch register this way, so flag and name errors need no torch."""

    path: str


@dataclass(frozen=True)
class Entry:
    """A registered implementation and where it came from."""

    name: str
    obj: Any
    provider: str  # plugin name as registered with pluggy
    distribution: str  # "vime 0.1.0", "vime-sandbox-docker 0.1.0", or "dotted path"


class Registry(Generic[T]):
    """Names of one plugin kind (``generate``, ``reward``, ``sandbox``, …), each resolving to a ``T``.

    :param kind: the kind, used in messages and the ``pip install`` hint.
    :param flag: the command-line flag that selects a name (for messages).
    :param check: optional ``check(name, obj)`` raising :class:`RegistryError` if ``obj`` does not fit the kind
        (:func:`check_protocol`, :func:`check_subclass`); the registry prefixes its message with who registered
        what (or which flag named the dotted path). A registered class with a ``NAME`` must be registered under it.
    :param adapt: optional ``adapt(name, obj)`` returning what the registry holds for ``obj`` once it passed the
        check (the function kinds wrap a deprecated ``(args, ...)`` function:
        :func:`vime_core.config.context.adapt_legacy`).
    """

    def __init__(
        self,
        kind: str,
        flag: str,
        check: Callable[[str, Any], None] | None = None,
        adapt: Callable[[str, Any], Any] | None = None,
    ) -> None:
        self.kind = kind
        self.flag = flag
        self._check = check
        self._adapt = adapt
        self._dotted: dict[str, Any] = {}
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, obj: T, provider: str, distribution: str) -> None:
        """Register ``obj`` under ``name``.

        :raises RegistryError: if ``name`` is already taken (naming both providers), ``obj`` fails the check, or
            ``obj`` is a class whose ``NAME`` is not ``name``.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} registered by {provider} ({distribution}) has an invalid name {name!r}")
        if name in self._entries:
            old = self._entries[name]
            raise RegistryError(
                f"duplicate {self.kind} name {name!r}: provided by plugin {old.provider!r} ({old.distribution}) "
                f"and by plugin {provider!r} ({distribution}); uninstall one or block it with VIME_DISABLE_PLUGINS"
            )
        if isinstance(obj, Lazy):  # checked when resolved
            self._entries[name] = Entry(name, obj, provider, distribution)
            return
        self._entries[name] = self._checked(name, obj, provider, distribution)

    def _checked(self, name: str, obj: Any, provider: str, distribution: str) -> Entry:
        """The entry of ``obj`` once it passed the check, the ``NAME`` rule and ``adapt``.

        :raises RegistryError: ``obj`` fails the check or its ``NAME`` is not ``name``.
        """
        where = f"plugin {provider!r} ({distribution}) registers {self.kind} {name!r} = {describe(obj)}"
        if self._check is not None:
            try:
                self._check(name, obj)
            except RegistryError as e:
                raise RegistryError(f"{where}: {e}") from None
        if isinstance(obj, type) and hasattr(obj, "NAME") and obj.NAME != name:
            raise RegistryError(
                f"{where}: its NAME is {obj.NAME!r}; a class registers under its own NAME "
                f"(register({obj.__name__}.NAME, {obj.__name__}), or set NAME = {name!r})"
            )
        if self._adapt is not None:
            obj = self._adapt(name, obj)
        return Entry(name, obj, provider, distribution)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        """Registered entries, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> T:
        """Resolve a registered name or a dotted ``pkg.mod:obj`` / ``pkg.mod.obj`` path.

        :raises RegistryError: unknown name (listing the available ones), or a dotted path that does not import.
        """
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry.obj, Lazy):
                where = f"{self.kind} {name!r} of plugin {entry.provider!r} ({entry.distribution})"
                obj = _load_dotted(entry.obj.path, where)
                entry = self._entries[name] = self._checked(name, obj, entry.provider, entry.distribution)
            return entry.obj
        if ":" in name or "." in name:
            obj = _load_dotted(name, self.flag)
            if self._check is not None:
                try:
                    self._check(name, obj)
                except RegistryError as e:
                    raise RegistryError(f"{self.flag} {name!r} = {describe(obj)}: {e}") from None
            if self._adapt is None:
                return obj
            held = self._dotted.get(name)  # adapted once per path (a deprecated form warns once)
            if held is None or held[0] is not obj:
                held = self._dotted[name] = (obj, self._adapt(name, obj))
            return held[1]
        hint = KNOWN_PROVIDERS.get((self.kind, name))
        msg = f"unknown {self.kind} {name!r} for {self.flag}; available: {', '.join(self.names()) or '(none)'}"
        if hint:
            msg += f". {name!r} is provided by the {hint} distribution: pip install {hint}"
        else:
            msg += ". A dotted path 'package.module:object' is accepted too"
        raise RegistryError(msg)


def _load_dotted(path: str, flag: str) -> Any:
    """The object at ``path`` (``pkg.mod:obj`` or ``pkg.mod.obj``).

    :raises RegistryError: naming ``flag`` and the path: the module cannot be found, raises while it is imported
        (its exception as one line: the type, the message and where it was raised), or lacks the object.
    """
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise RegistryError(f"{flag} {path!r}: cannot import module {mod_name!r}: {e}") from None
    except Exception as e:  # the module itself raised: one line, not its traceback
        raise RegistryError(
            f"{flag} {path!r}: importing module {mod_name!r} raised {type(e).__name__}: {e}{_raised_at(e)}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise RegistryError(f"{flag} {path!r}: module {mod_name!r} has no attribute {attr!r}") from e


def _raised_at(error: BaseException) -> str:
    """`` (at FILE:LINE)``: the innermost frame of ``error``'s traceback outside the import machinery."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "importlib" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def describe(obj: Any) -> str:
    """``module.qualname`` of a function or class (what error messages call it), else its ``repr``."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


def _signature_text(sig: inspect.Signature, is_async: bool) -> str:
    """``async def (args, sample)``: a signature with annotations dropped, as the messages print it."""
    bare = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()], return_annotation=sig.empty
    )
    return f"{'async def' if is_async else 'def'} {bare}"


def check_callable_signature(*params: str, is_async: bool | None = None) -> Callable[[str, Any], None]:
    """A registry check: ``obj`` is callable, its first positional parameters are named ``params`` (in order), any
    further parameter has a default, and (optionally) it is (or is not) a coroutine function.

    The check raises :class:`RegistryError` with ``expected <signature>, found <signature>``; the registry adds
    which plugin registered what under which name.
    """
    expected = f"{'async def' if is_async else 'def'} ({', '.join(params)})"

    def check(name: str, obj: Any) -> None:
        if not callable(obj):
            raise RegistryError(f"expected a callable {expected}, found a {type(obj).__name__} object")
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return  # a builtin without introspectable signature: nothing to check
        found_async = inspect.iscoroutinefunction(obj)
        ps = list(sig.parameters.values())
        positional = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        extra_required = [
            p for p in ps[len(params) :] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        wrong_async = is_async is not None and found_async != is_async
        if tuple(positional[: len(params)]) != params or extra_required or wrong_async:
            raise RegistryError(f"expected {expected}, found {_signature_text(sig, found_async)}")

    return check


def check_protocol(protocol: type) -> Callable[[str, Any], None]:
    """A registry check against a :mod:`vime_core.plugins.protocols` class: the parameter names of its ``__call__``
    (after ``self``) and whether it is ``async`` (see :func:`check_callable_signature`). A first parameter ``ctx``
    may also be named ``args``: the deprecated ``(args, ...)`` form (:func:`vime_core.config.context.adapt_legacy`)."""
    call = protocol.__call__
    params = list(inspect.signature(call).parameters)[1:]
    is_async = inspect.iscoroutinefunction(call)
    new = check_callable_signature(*params, is_async=is_async)
    if not params or params[0] != "ctx":
        return new
    legacy = check_callable_signature("args", *params[1:], is_async=is_async)

    def check(name: str, obj: Any) -> None:
        try:
            legacy(name, obj)
        except RegistryError:
            new(name, obj)

    return check


def check_subclass(base: type | str) -> Callable[[str, Any], None]:
    """A registry check: ``obj`` is a subclass of ``base`` (a class, or its ``"pkg.module:Class"`` path, imported
    at the first check: the trainer and weight-sync bases import torch)."""

    def check(name: str, obj: Any) -> None:
        cls = base
        if isinstance(cls, str):
            module, _, qualname = cls.partition(":")
            cls = getattr(importlib.import_module(module), qualname)
        if not (isinstance(obj, type) and issubclass(obj, cls)):
            raise RegistryError(f"expected a subclass of {cls.__module__}.{cls.__qualname__}, found {describe(obj)}")

    return check
