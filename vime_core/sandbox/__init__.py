"""Sandboxes: one contract (:class:`Sandbox`), backends registered through ``vime_register_sandbox_backends``.

``local`` is built in (:mod:`vime_core.sandbox.local`); ``docker``, ``localvm``, ``e2b`` and ``modal`` are plugins.
Use :func:`open_sandbox` to build the one a run asks for (``--sandbox NAME``, resolved by the plugins on the
context), and :func:`vime_core.plugins.manager.cleanup_all` (or ``vime sandbox cleanup``) to remove what killed vime
processes left behind.
"""

from __future__ import annotations

from typing import Any

from vime_core.sandbox import base
from vime_core.sandbox.base import *  # noqa: F403 - the contract's names, listed once: base.__all__
from vime_core.sandbox.base import Sandbox

__all__ = [*base.__all__, "open_sandbox"]


def open_sandbox(ctx: Any = None, name: str | None = None, **kwargs: Any) -> Sandbox:
    """A not-yet-started sandbox of backend ``name`` (default: the run's ``--sandbox``, else ``local``), built from
    the run's :class:`~vime_core.config.context.PluginContext` ``ctx`` by the backend's
    :meth:`~vime_core.sandbox.base.Sandbox.from_context` (``None``: the backend's defaults); use it as
    ``async with open_sandbox(ctx) as sb: ...``. Keywords go to the constructor. The name is resolved by the
    plugins the context carries (``ctx.plugins``); without them only ``local`` can be opened.

    :raises vime_core.plugins.registry.RegistryError: unknown backend name.
    :raises ValueError: a backend other than ``local`` without a context that carries the plugins.
    """
    name = name or (ctx.sandbox.sandbox if ctx is not None else None) or "local"
    plugins = getattr(ctx, "plugins", None)
    if plugins is not None:
        cls = plugins.resolve("sandbox", name)
    elif name == "local":
        from vime_core.sandbox.local import LocalSandbox

        cls = LocalSandbox
    else:
        raise ValueError(
            f"open_sandbox({name!r}): resolving a sandbox backend needs the plugin context vime hands a plugin "
            "function (ctx.plugins; in tests vime_core.testing.plugin_context.plugin_context())"
        )
    return cls.from_context(ctx, **kwargs) if ctx is not None else cls.from_config(**kwargs)
