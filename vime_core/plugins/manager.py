"""The plugin manager: built-ins and entry-point plugins, loaded once, with typed registries.

Discovery: modules in :data:`DEFAULT_PLUGINS` (the built-ins) and every entry point of group ``vime``.
Switches: ``VIME_DISABLE_PLUGINS=a,b`` blocks plugins by name; ``VIME_LOAD_PLUGINS=a,b`` loads only those
entry-point plugins (empty string: none). A plugin that fails to import is recorded with its distribution and
version (:attr:`Plugins.failed`) and fails the run only when the run asks for a name it would have provided.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from vime_core.config import ConfigError, PluginConfig, check_plugin_config
from vime_core.config.context import adapt_legacy
from vime_core.plugins import hookspecs
from vime_core.plugins.protocols import AdvantageEstimator, DynamicFilter, GenerateFn, GroupRewardFn, RewardFn
from vime_core.plugins.registry import Registry, RegistryError, check_protocol, check_subclass
from vime_core.version import __version__

if TYPE_CHECKING:
    from vime_core.sandbox.base import CleanupReport

logger = logging.getLogger("vime.plugins")

ENTRY_POINT_GROUP = "vime"
DEFAULT_PLUGINS: tuple[str, ...] = (
    "vime_core.builtins.generate",
    "vime_core.builtins.rewards",
    "vime_core.builtins.advantages",
    "vime_core.builtins.trainers",
    "vime_core.builtins.weight_sync",
    "vime_core.builtins.sandboxes",
)

#: registry kind → the ``vime_register_*`` hook that fills it
REGISTER_HOOKS: dict[str, str] = {
    "generate": "vime_register_generate_functions",
    "reward": "vime_register_reward_functions",
    "group_reward": "vime_register_group_reward_functions",
    "advantage": "vime_register_advantage_estimators",
    "dynamic_filter": "vime_register_dynamic_sampling_filters",
    "sandbox": "vime_register_sandbox_backends",
    "agent": "vime_register_agent_harnesses",
    "weight_sync": "vime_register_weight_sync_strategies",
    "trainer": "vime_register_trainer_backends",
    "flags": "vime_register_flags",
}


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin."""

    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    error: str | None = None


class Plugins:
    """Loaded plugins and one :class:`Registry` per plugin kind.

    Build with :func:`get_plugins`; registries: ``generate``, ``reward``, ``group_reward``, ``advantage``,
    ``dynamic_filter``, ``sandbox``, ``agent``, ``weight_sync``, ``trainer``, ``flags`` (plugins' flag classes).
    """

    def __init__(self) -> None:
        # the base classes by path, imported at their first check: the trainer and weight-sync bases import torch,
        # and `arguments` (flag errors in under a second) and `sandbox` import this module for get_plugins only
        sandbox, agent = "vime_core.sandbox.base:Sandbox", "vime_core.agent.harness:AgentHarness"
        weight_sync, trainer = "vime_core.weight_sync.base:WeightSyncStrategy", "vime_core.trainer.base:TrainerBackend"
        self.pm = pluggy.PluginManager("vime")
        self.pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self.failed: list[PluginInfo] = []
        self.registries: dict[str, Registry[Any]] = {
            "generate": Registry[GenerateFn]("generate", "--generate", check_protocol(GenerateFn), _adapt("generate")),
            "reward": Registry[RewardFn]("reward", "--reward", check_protocol(RewardFn), _adapt("reward")),
            "group_reward": Registry[GroupRewardFn](
                "group_reward", "--group-reward", check_protocol(GroupRewardFn), _adapt("group_reward")
            ),
            "advantage": Registry[AdvantageEstimator](
                "advantage", "--advantage-estimator", check_protocol(AdvantageEstimator), _adapt("advantage")
            ),
            "dynamic_filter": Registry[DynamicFilter](
                "dynamic_filter", "--dynamic-sampling-filter", check_protocol(DynamicFilter), _adapt("dynamic_filter")
            ),
            "sandbox": Registry[type]("sandbox", "--sandbox", check_subclass(sandbox)),
            "agent": Registry[type]("agent", "--agent", check_subclass(agent)),
            "weight_sync": Registry[type]("weight_sync", "--weight-sync", check_subclass(weight_sync)),
            "trainer": Registry[type]("trainer", "--trainer", check_subclass(trainer)),
            "flags": Registry[type[PluginConfig]]("flags", "vime_register_flags", _check_flags),
        }

    # -- loading ---------------------------------------------------------------------------------------------
    def load(self) -> Plugins:
        blocked = {n.strip() for n in os.environ.get("VIME_DISABLE_PLUGINS", "").split(",") if n.strip()}
        for name in blocked:
            self.pm.set_blocked(name)
        for modname in DEFAULT_PLUGINS:
            if modname in blocked:
                continue
            self.pm.register(importlib.import_module(modname), name=modname)
            self.info[modname] = PluginInfo(modname, "vime", __version__)
        only = os.environ.get("VIME_LOAD_PLUGINS")
        only_set = None if only is None else {n.strip() for n in only.split(",") if n.strip()}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in blocked or (only_set is not None and ep.name not in only_set):
                continue
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                module = ep.load()
            except Exception as e:  # noqa: BLE001 - any import-time failure is reported, not raised
                info = PluginInfo(ep.name, dist, version, error=f"{type(e).__name__}: {e}")
                logger.warning("error loading vime plugin %r (%s %s): %s", ep.name, dist, version, info.error)
                self.failed.append(info)
                continue
            if self.pm.is_registered(module) or self.pm.get_plugin(ep.name) is not None:
                continue
            self.pm.register(module, name=ep.name)
            self.info[ep.name] = PluginInfo(ep.name, dist, version)
        self.pm.check_pending()
        for name, plugin in self.pm.list_name_plugin():
            if name in self.info:
                self.info[name].hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
        self._fill_registries()
        return self

    def _fill_registries(self) -> None:
        for kind, hook_name in REGISTER_HOOKS.items():
            registry = self.registries[kind]
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                info = self.info.get(impl.plugin_name)
                dist = f"{info.distribution} {info.version}" if info else "?"

                def register(name: str, obj: Any, _r=registry, _p=impl.plugin_name, _d=dist) -> None:
                    _r.add(name, obj, _p, _d)

                impl.function(register=register)

    def flag_classes(self) -> list[type[PluginConfig]]:
        """The :class:`~vime_core.config.PluginConfig` classes the installed plugins register, in load order."""
        return [entry.obj for entry in self.registries["flags"].entries()]

    # -- lookup ----------------------------------------------------------------------------------------------
    def resolve(self, kind: str, name: str) -> Any:
        """Resolve ``name`` in the ``kind`` registry.

        :raises RegistryError: unknown name; if a plugin failed to load, the message says which and why.
        """
        try:
            return self.registries[kind].get(name)
        except RegistryError as e:
            if self.failed:
                broken = "; ".join(f"{p.name} ({p.distribution} {p.version}): {p.error}" for p in self.failed)
                raise RegistryError(f"{e}. Plugins that failed to load: {broken}") from None
            raise

    def describe(self) -> list[dict[str, Any]]:
        """One dict per plugin: name, distribution, version, hooks, what it provides (per kind), load error."""
        provides: dict[str, dict[str, list[str]]] = {}
        for kind, reg in self.registries.items():
            for entry in reg.entries():
                provides.setdefault(entry.provider, {}).setdefault(kind, []).append(entry.name)
        rows = []
        for info in list(self.info.values()) + self.failed:
            rows.append(
                {
                    "name": info.name,
                    "distribution": info.distribution,
                    "version": info.version,
                    "hooks": info.hooks,
                    "provides": provides.get(info.name, {}),
                    "error": info.error,
                }
            )
        return rows


def _adapt(kind: str) -> Callable[[str, Any], Any]:
    """The registry's ``adapt`` for a function kind: a deprecated ``(args, ...)`` function wrapped once."""
    return lambda name, obj: adapt_legacy(obj, kind, name)


def _check_flags(prefix: str, cls: Any) -> None:
    """The ``flags`` registry's check: :func:`vime_core.config.check_plugin_config`, as a registry error."""
    try:
        check_plugin_config(prefix, cls)
    except ConfigError as e:
        raise RegistryError(str(e)) from None


_PLUGINS: Plugins | None = None


def get_plugins(reload: bool = False) -> Plugins:
    """The process-wide :class:`Plugins`, loaded on first use."""
    global _PLUGINS
    if _PLUGINS is None or reload:
        _PLUGINS = Plugins().load()
    return _PLUGINS


def cleanup_all(*, backend: str | None = None, everything: bool = False) -> list[CleanupReport]:
    """Run every registered sandbox backend's reaper (or only ``backend``'s): ``vime sandbox cleanup``.

    :param everything: remove all vime sandboxes, including those of running processes.
    :returns: one report per backend; a backend whose reaper raised reports the error instead.
    """
    from vime_core.sandbox.base import CleanupReport

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
