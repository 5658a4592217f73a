"""Deprecated (goes in vime 0.2): the engines a generate function used before they came on its context.

A plugin function reads them from the context it is handed: ``ctx.engines`` (:class:`vime_core.config.context.Engines`:
the router client, the tokenizer, the served weight version). Until 0.2, :func:`get_rollout_context` still answers
inside a plugin call of vime's rollout (the group runner sets the engines of each call), and
:func:`set_rollout_context` installs engines for a context built without them (tests written for 0.1).
"""

from __future__ import annotations

import warnings

from vime_core.config.context import CURRENT_ENGINES, Engines

#: the old name of :class:`vime_core.config.context.Engines`
RolloutContext = Engines

__all__ = ["RolloutContext", "get_rollout_context", "set_rollout_context"]


def set_rollout_context(ctx: Engines | None) -> None:
    """Install (or clear) the engines a context built without them falls back to, in this thread's context
    (``DeprecationWarning``: build the context with them, ``PluginContext(config, engines=...)``)."""
    warnings.warn(
        "vime_core.rollout.context.set_rollout_context is deprecated and goes in vime 0.2: hand the engines on the "
        "plugin context, PluginContext(config, engines=Engines(client, tokenizer)) (in tests "
        "vime_core.testing.plugin_context.plugin_context(engines=...))",
        DeprecationWarning,
        stacklevel=2,
    )
    CURRENT_ENGINES.set(ctx)


def get_rollout_context() -> Engines:
    """The engines of the plugin call in progress (``DeprecationWarning``: read ``ctx.engines``).

    :raises RuntimeError: outside a plugin call of vime's rollout, with none installed.
    """
    warnings.warn(
        "vime_core.rollout.context.get_rollout_context is deprecated and goes in vime 0.2: read ctx.engines (the "
        "PluginContext the plugin function is handed)",
        DeprecationWarning,
        stacklevel=2,
    )
    engines = CURRENT_ENGINES.get()
    if engines is None:
        raise RuntimeError("no rollout context: generate functions run inside vime's rollout manager")
    return engines
