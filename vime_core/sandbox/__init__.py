"""Sandboxes: one contract (:class:`Sandbox`), backends registered through ``vime_register_sandbox_backends``.

``local`` is built in (:mod:`vime_core.sandbox.local`); ``docker``, ``localvm``, ``e2b`` and ``modal`` are plugins.
Use :func:`open_sandbox` to build the one a run asks for (``--sandbox NAME``), and :func:`cleanup_all` (or
``vime sandbox cleanup``) to remove what killed vime processes left behind.
"""

from __future__ import annotations

from typing import Any

from vime_core.plugins import get_plugins
from vime_core.sandbox import base
from vime_core.sandbox.base import *  # noqa: F403 - the contract's names, listed once: base.__all__
from vime_core.sandbox.base import CleanupReport, Sandbox

__all__ = [*base.__all__, "cleanup_all", "open_sandbox"]


def open_sandbox(ctx: Any = None, name: str | None = None, **kwargs: Any) -> Sandbox:
    """A not-yet-started sandbox of backend ``name`` (default: the run's ``--sandbox``, else ``local``), built from
    the run's :class:`~vime_core.context.PluginContext` ``ctx`` by the backend's
    :meth:`~vime_core.sandbox.base.Sandbox.from_context` (``None``: the backend's defaults); use it as
    ``async with open_sandbox(ctx) as sb: ...``. Keywords go to the constructor.

    :raises vime_core.registry.RegistryError: unknown backend name.
    """
    name = name or (ctx.sandbox.sandbox if ctx is not None else None) or "local"
    cls = get_plugins().resolve("sandbox", name)
    return cls.from_context(ctx, **kwargs) if ctx is not None else cls.from_config(**kwargs)


def cleanup_all(*, backend: str | None = None, everything: bool = False) -> list[CleanupReport]:
    """Run every registered backend's reaper (or only ``backend``'s).

    :param everything: remove all vime sandboxes, including those of running processes.
    :returns: one report per backend; a backend whose reaper raised reports the error instead.
    """
    reg = get_plugins().registries["sandbox"]
    reports = []
    for entry in reg.entries():
        if backend is not None and entry.name != backend:
            continue
        try:
            reports.append(reg.get(entry.name).cleanup(everything=everything))  # resolved: a Lazy entry imports
        except Exception as e:  # noqa: BLE001 - one backend's service being down must not hide the others
            reports.append(CleanupReport(entry.name, errors=[f"{type(e).__name__}: {e}"]))
    return reports
