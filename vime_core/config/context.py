"""What a plugin function receives: :class:`PluginContext`, the typed run configuration it may read, the rollout's
engines (:class:`Engines`: router client, tokenizer, the served weight version) and the loaded plugins.

Generate functions (``generate(ctx, sample, sampling_params)``), rewards (``reward(ctx, sample)``), group rewards
(``group_reward(ctx, group)``), dynamic-sampling filters (``filter(ctx, group)``) and advantage estimators
(``estimator(ctx, group)``) get a :class:`PluginContext` as their first argument. Functions written for the
``(args, ...)`` form of vime 0.1 still work until vime 0.2: :func:`adapt_legacy` wraps them once (a
``DeprecationWarning`` naming the new signature) and hands them :func:`legacy_namespace`, a Namespace built from the
typed tree. docs/plugins.md.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

from vime_core.config import (
    AlgorithmConfig,
    CodingAgentConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    LoraConfig,
    MultiTurnConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
)

T = TypeVar("T")

#: the signature each kind of plugin function has now (named in the deprecation warning of an ``(args, ...)`` one)
NEW_SIGNATURES = {
    "generate": "async def generate(ctx: PluginContext, sample, sampling_params)",
    "reward": "async def reward(ctx: PluginContext, sample)",
    "group_reward": "async def group_reward(ctx: PluginContext, group)",
    "dynamic_filter": "def filter(ctx: PluginContext, group) -> bool",
    "advantage": "def estimator(ctx: PluginContext, group) -> list[list[float]]",
}


class ServedVersion:
    """The weight version the engines serve now: one holder, written by the engine fleet after each weight update
    and read by the router client (the tokens of a release that tags none), the group runner and plugin functions
    (``ctx.engines.weight_version``).

    :ivar value: the version (0: the initial weights).
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value


class Engines:
    """What a plugin function may use of the rollout's engines (``ctx.engines``; slime's ``GenerateState``).

    :param client: a :class:`vime_core.engines.client.RouterClient` to the router (``None`` until the engines start).
    :param tokenizer: the policy's Hugging Face tokenizer.
    :param weight_version: the initial version of a new :class:`ServedVersion` (ignored when ``served`` is given).
    :param extras: room for per-process state of plugins (the agent gateway, harness instances, ...).
    :param served: the holder of the served weight version to share (default: a new one).
    """

    def __init__(
        self,
        client: Any = None,
        tokenizer: Any = None,
        weight_version: int = 0,
        extras: dict[str, Any] | None = None,
        *,
        served: ServedVersion | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served = served if served is not None else ServedVersion(weight_version)
        self.extras: dict[str, Any] = extras if extras is not None else {}

    @property
    def weight_version(self) -> int:
        """The version of the weights the engines serve now."""
        return self.served.value

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.served.value = version


class PluginResolver(Protocol):
    """What a plugin function may ask of the loaded plugins (``ctx.plugins``: the plugin manager,
    :class:`vime_core.plugins.manager.Plugins`, handed in by whoever builds the context)."""

    def resolve(self, kind: str, name: str) -> Any:
        """The implementation registered as ``name`` for plugin ``kind`` (``"sandbox"``, ``"reward"``, ...).

        :raises vime_core.plugins.registry.RegistryError: an unknown name.
        """


#: the engines of the plugin call in progress, for the deprecated ``vime_core.rollout.context`` functions (set by
#: the group runner for every call it makes, and by ``set_rollout_context``; goes in vime 0.2 with them)
CURRENT_ENGINES: ContextVar[Engines | None] = ContextVar("vime_current_engines", default=None)


@dataclass(frozen=True, slots=True)
class PluginContext:
    """The run as a plugin function sees it: the config sections it may read and its own plugin config, the
    rollout's engines and the loaded plugins.

    :ivar config: the whole :class:`~vime_core.config.RunConfig`; the properties below are its sections.
    :ivar engines: the rollout's :class:`Engines` (``None`` in a context of the driver: advantage estimators,
        ``vime_on_train_step_end``); generate functions read it through :func:`rollout_engines`.
    :ivar plugins: the loaded plugins, to resolve a name with (``None`` in a context built without them).
    """

    config: RunConfig
    engines: Engines | None = None
    plugins: PluginResolver | None = None

    @property
    def data(self) -> DataConfig:
        """Prompt data (``--prompt-data``, the input/label keys)."""
        return self.config.data

    @property
    def rollout(self) -> RolloutConfig:
        """Rollout sampling, the generate/reward plugins, over-sampling."""
        return self.config.rollout

    @property
    def engine(self) -> EngineConfig:
        """The vLLM engines and the router."""
        return self.config.engine

    @property
    def reward(self) -> RewardConfig:
        """The reward function and the built-in rewards' flags."""
        return self.config.reward

    @property
    def eval(self) -> EvalConfig:
        """Held-out evaluation."""
        return self.config.eval

    @property
    def algorithm(self) -> AlgorithmConfig:
        """Advantage estimators and loss terms."""
        return self.config.algorithm

    @property
    def lora(self) -> LoraConfig:
        """LoRA (``--lora-rank``)."""
        return self.config.lora

    @property
    def sandbox(self) -> SandboxConfig:
        """The sandbox backend and its limits."""
        return self.config.sandbox

    @property
    def multi_turn(self) -> MultiTurnConfig:
        """The multi_turn generate function's flags."""
        return self.config.multi_turn

    @property
    def coding_agent(self) -> CodingAgentConfig:
        """The coding_agent generate function's flags."""
        return self.config.coding_agent

    def plugin(self, cls: type[T]) -> T:
        """The run's instance of the plugin config class ``cls`` (its own prefixed flags)."""
        return self.config.plugin(cls)  # type: ignore[attr-defined]


def rollout_engines(ctx: PluginContext) -> Engines:
    """``ctx.engines``; for a context built without them, the engines installed with the deprecated
    ``vime_core.rollout.context.set_rollout_context`` (tests written for vime 0.1; goes in vime 0.2).

    :raises RuntimeError: neither (a generate function runs inside vime's rollout, whose context has them).
    """
    if ctx.engines is not None:
        return ctx.engines
    installed = CURRENT_ENGINES.get()
    if installed is None:
        raise RuntimeError(
            "the plugin context has no engines: generate functions run inside vime's rollout (in tests, build the "
            "context with them: vime_core.testing.plugin_context.plugin_context(engines=Engines(client, tokenizer)))"
        )
    return installed


def legacy_namespace(config: RunConfig) -> argparse.Namespace:
    """A Namespace for ``(args, ...)`` plugin functions and hook implementations, built from the typed tree: every
    field of every section by name, then every plugin config's fields (never the parsed command line itself)."""
    values: dict[str, Any] = {}
    for f in fields(config):
        section = getattr(config, f.name)
        if f.name == "plugins":
            continue
        for sf in fields(section):
            values[sf.name] = getattr(section, sf.name)
    for plugin_config in getattr(config, "plugins", ()) or ():
        for pf in fields(plugin_config):
            values[pf.name] = getattr(plugin_config, pf.name)
    return argparse.Namespace(**values)


_LEGACY: dict[int, tuple[RunConfig, argparse.Namespace]] = {}
# id of a Namespace legacy_args built → (that Namespace, the context of its config): a built-in called by an
# (args, ...) plugin with that Namespace gets the run's real context back (plugin configs, engines and plugins)
_CONTEXT_OF: dict[int, tuple[argparse.Namespace, PluginContext]] = {}


def legacy_args(config: RunConfig, ctx: PluginContext | None = None) -> argparse.Namespace:
    """:func:`legacy_namespace` of ``config``, built once per config object (the ``args`` the deprecated
    ``(args, ...)`` hook implementations and plugin functions get); ``ctx``: the context of the call, which a
    built-in called back with that Namespace gets (default: one of ``config`` alone)."""
    hit = _LEGACY.get(id(config))
    if hit is None or hit[0] is not config:
        hit = _LEGACY[id(config)] = (config, legacy_namespace(config))
        _CONTEXT_OF[id(hit[1])] = (hit[1], PluginContext(config))
    if ctx is not None and ctx.config is config:
        _CONTEXT_OF[id(hit[1])] = (hit[1], ctx)
    return hit[1]


def overrides_from_args_only(cls: type, base: type) -> bool:
    """Whether ``cls`` (a sandbox backend or agent harness written for vime 0.x) overrides ``from_args`` but not
    ``from_config`` of ``base``: then it must still be built by its ``from_args``."""
    own_args = getattr(cls.from_args, "__func__", None) is not base.from_args.__func__  # type: ignore[attr-defined]
    own_config = getattr(cls.from_config, "__func__", None) is not base.from_config.__func__  # type: ignore[attr-defined]
    return own_args and not own_config


def warn_built_from_args(cls: type, what: str, new_form: str) -> None:
    """The ``DeprecationWarning`` of a class plugin still built by its ``from_args`` from a Namespace, attributed to
    the caller of the ``from_context`` that calls this. ``what`` names the kind (``"sandbox backend"``), ``new_form``
    the method to override instead."""
    warnings.warn(
        f"{what} {cls.__name__} is built from an argparse.Namespace (from_args); declare its flag class as FLAGS "
        f"and override {new_form} instead: from_args stops being called in vime 0.2",
        DeprecationWarning,
        stacklevel=3,
    )


def as_context(value: PluginContext | argparse.Namespace) -> PluginContext:
    """The :class:`PluginContext` of a built-in plugin function's first argument. An ``(args, ...)`` plugin that
    calls a built-in (a custom generate wrapping the default one) passes its Namespace: the one vime handed it maps
    back to the run's context; any other Namespace is read as a whole run's flags (``DeprecationWarning``).

    :raises TypeError: ``value`` is neither.
    """
    if isinstance(value, PluginContext):
        return value
    hit = _CONTEXT_OF.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if isinstance(value, argparse.Namespace):
        warnings.warn(
            "passing an argparse.Namespace to a vime plugin function is deprecated and stops working in vime 0.2; "
            "pass the PluginContext (vime_core.config.context; in tests "
            "vime_core.testing.plugin_context.plugin_context(**flags))",
            DeprecationWarning,
            stacklevel=3,
        )
        return PluginContext(RunConfig.from_args(value))
    raise TypeError(f"a plugin function's first argument is a PluginContext, got {type(value).__name__}")


F = TypeVar("F", bound=Callable[..., Any])


def takes_context(fn: F) -> F:
    """Decorator of the built-in plugin functions: their first argument goes through :func:`as_context`, so
    ``(args, ...)`` plugins can still call them during the deprecation window."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(ctx: Any, *rest: Any, **kw: Any) -> Any:
            return await fn(as_context(ctx), *rest, **kw)

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(ctx: Any, *rest: Any, **kw: Any) -> Any:
        return fn(as_context(ctx), *rest, **kw)

    return wrapper  # type: ignore[return-value]


def is_legacy(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has the ``(args, ...)`` form of vime 0.x (its first parameter is named ``args``)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: not a legacy plugin function
        return False
    return bool(params) and params[0] == "args"


def adapt_legacy(fn: Callable[..., Any], kind: str, name: str) -> Callable[..., Any]:
    """``fn`` itself in the ``(ctx, ...)`` form; an ``(args, ...)`` function wrapped to take a :class:`PluginContext`
    (it gets :func:`legacy_namespace` of the context's config), warning once that the form is deprecated."""
    if not is_legacy(fn):
        return fn
    warnings.warn(
        f"{kind} {name!r} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}) takes (args, ...), "
        f"which is deprecated and stops working in vime 0.2; use {NEW_SIGNATURES[kind]} "
        "(vime_core.config.context.PluginContext; docs/plugins.md)",
        DeprecationWarning,
        stacklevel=3,
    )
    if inspect.iscoroutinefunction(fn):

        async def async_wrapper(ctx: PluginContext, *rest: Any, **kw: Any) -> Any:
            return await fn(_legacy_arg(ctx), *rest, **kw)

        return _named_like(async_wrapper, fn)

    def wrapper(ctx: PluginContext, *rest: Any, **kw: Any) -> Any:
        return fn(_legacy_arg(ctx), *rest, **kw)

    return _named_like(wrapper, fn)


def _legacy_arg(ctx: PluginContext | argparse.Namespace) -> argparse.Namespace:
    """What an ``(args, ...)`` function gets: the Namespace of the context's config, or the Namespace an
    ``(args, ...)`` caller passed on."""
    return ctx if isinstance(ctx, argparse.Namespace) else legacy_args(ctx.config, ctx)


def _named_like(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` with ``fn``'s name, module and docstring (not its signature: the wrapper takes a context)."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(fn, attr):
            setattr(wrapper, attr, getattr(fn, attr))
    wrapper.__vime_legacy__ = fn  # type: ignore[attr-defined]
    return wrapper
