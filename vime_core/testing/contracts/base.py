"""Common machinery of every contract: capability skips and the no-override guard."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, ClassVar

import pytest

from vime_core.config.context import adapt_legacy

#: the package every contract class lives in (``test_no_overrides`` finds the contract in a subclass's MRO by it)
_PACKAGE = __name__.rpartition(".")[0]


class _Contract:
    """Common machinery: capability skips and the no-override guard."""

    capabilities: ClassVar[set[str]] = set()

    def require(self, capability: str) -> None:
        """Skip (with the reason printed) unless the subclass declared ``capability``."""
        if capability not in self.capabilities:
            pytest.skip(f"{type(self).__name__} does not declare capability {capability!r}")

    def test_no_overrides(self) -> None:
        """Contract tests may be overridden only when marked ``xfail(reason=...)``."""
        base = next(c for c in type(self).__mro__ if c.__module__.startswith(_PACKAGE + ".") and c is not _Contract)
        for name, member in inspect.getmembers(base, inspect.isfunction):
            if not name.startswith("test_"):
                continue
            impl = getattr(type(self), name)
            if impl is not member:
                marks = [m for m in getattr(impl, "pytestmark", []) if m.name == "xfail" and m.kwargs.get("reason")]
                assert marks, f"{type(self).__name__}.{name} overrides a contract test without xfail(reason=...)"


def adapted(fn: Any, kind: str) -> Any:
    """``fn`` as the registry would hold it: a deprecated ``(args, ...)`` function wrapped to take a
    :class:`~vime_core.config.context.PluginContext` (its DeprecationWarning is the signature test's to check, so it is
    not repeated here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return adapt_legacy(fn, kind, "contract")
