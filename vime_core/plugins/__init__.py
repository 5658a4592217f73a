"""The plugin system: hook specs (:mod:`.hookspecs`), the typed contracts of the callable kinds
(:mod:`.protocols`), name registries (:mod:`.registry`) and the plugin manager (:mod:`.manager`), the only room
below ``run/`` and ``rollout/`` that resolves a plugin name.
"""

from __future__ import annotations

import warnings
from typing import Any

#: the plugin manager's public names, which vime 0.1 had at ``vime_core.plugins``
_MANAGER_NAMES = frozenset(
    {"DEFAULT_PLUGINS", "ENTRY_POINT_GROUP", "PluginInfo", "Plugins", "REGISTER_HOOKS", "cleanup_all", "get_plugins"}
)


def __getattr__(name: str) -> Any:
    """A name of the plugin manager at its 0.1 path (``vime_core.plugins.get_plugins``): one DeprecationWarning
    naming ``vime_core.plugins.manager``; the old path goes in vime 0.2."""
    if name not in _MANAGER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vime_core.plugins import manager

    warnings.warn(
        f"vime_core.plugins.{name} moved to vime_core.plugins.manager.{name}; the old path goes in vime 0.2",
        DeprecationWarning,
        stacklevel=2,  # the import or the attribute access (warnings skips importlib's own frames)
    )
    value = globals()[name] = getattr(manager, name)  # warned once
    return value
