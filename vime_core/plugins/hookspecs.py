"""Every vime hook, in one place.

Plugins implement these with ``@vime_core.hookimpl`` in a module named by an entry point of group ``vime``;
built-ins register through the same hooks (:data:`vime_core.plugins.manager.DEFAULT_PLUGINS`). The ``vime_register_*``
hooks receive a ``register(name, obj)`` callback, so the registry knows which plugin provided each name and fails
loudly on duplicates. The hooks, what ``obj`` must be, and which process calls which hook: docs/hooks.md and
docs/architecture.md ("Which hooks run where").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from vime_core.plugins.protocols import AdvantageEstimator, DynamicFilter, GenerateFn, GroupRewardFn, RewardFn

if TYPE_CHECKING:
    from argparse import ArgumentParser, Namespace

    from vime_core.config import PluginConfig
    from vime_core.config.context import PluginContext
    from vime_core.types import Sample

hookspec = pluggy.HookspecMarker("vime")
hookimpl = pluggy.HookimplMarker("vime")

#: the ``register(name, obj)`` callback of a ``vime_register_*`` hook (the typed aliases below say what ``obj`` is)
Register = Callable[[str, Any], None]
RegisterGenerate = Callable[[str, GenerateFn], None]
RegisterReward = Callable[[str, RewardFn], None]
RegisterGroupReward = Callable[[str, GroupRewardFn], None]
RegisterAdvantage = Callable[[str, AdvantageEstimator], None]
RegisterDynamicFilter = Callable[[str, DynamicFilter], None]
# The class kinds are named, not imported: their bases live a layer above this module (the registry checks each
# class against its base: vime_core.sandbox.base.Sandbox, vime_core.agent.harness.AgentHarness,
# vime_core.weight_sync.base.WeightSyncStrategy, vime_core.trainer.base.TrainerBackend).
RegisterSandbox = Callable[[str, type], None]
RegisterAgent = Callable[[str, type], None]
RegisterWeightSync = Callable[[str, type], None]
RegisterTrainer = Callable[[str, type], None]
RegisterFlags = Callable[[str, "type[PluginConfig]"], None]

# --------------------------------------------------------------------------------------------------------------
# Registration hooks (called once when the plugin manager is built)


@hookspec
def vime_register_generate_functions(register: RegisterGenerate) -> None:
    """Register generate functions by name (``--generate NAME``).

    A generate function is ``async def generate(ctx, sample, sampling_params) -> Sample | list[Sample]``
    (:class:`vime_core.plugins.protocols.GenerateFn`; ``ctx`` a :class:`~vime_core.config.context.PluginContext`, whose
    ``ctx.engines`` holds the router client, the tokenizer and the served weight version): it fills
    ``tokens``/``response``/``loss_mask``/``rollout_log_probs``/``weight_versions``/``status`` of ``sample``. The
    ``(args, sample, sampling_params)`` form of vime 0.1 still works, with a ``DeprecationWarning``; it goes in
    vime 0.2.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_reward_functions(register: RegisterReward) -> None:
    """Register reward functions by name (``--reward NAME``).

    A reward function is ``async def reward(ctx, sample) -> float | dict[str, float]``
    (:class:`vime_core.plugins.protocols.RewardFn`; ``(args, sample)`` warns and goes in vime 0.2). A reward that
    raises, exceeds ``--reward-timeout`` or returns NaN/±inf/a non-number marks the sample ``failed`` with that cause
    (:mod:`vime_core.failures`): excluded, never scored 0.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_group_reward_functions(register: RegisterGroupReward) -> None:
    """Register group reward functions by name (``--group-reward NAME``).

    A group reward function is ``async def group_reward(ctx, group: list[Sample]) -> list[float | dict[str, float]]``
    (:class:`vime_core.plugins.protocols.GroupRewardFn`; ``(args, group)`` warns and goes in vime 0.2):
    one score per sample of a prompt's group, in order (pairwise preference, rank-based rewards). It replaces
    ``--reward`` and gets the group's completed/truncated samples once all of them have finished generating.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_advantage_estimators(register: RegisterAdvantage) -> None:
    """Register advantage estimators by name (``--advantage-estimator NAME``).

    An estimator is ``fn(ctx, group: list[Sample]) -> list[list[float]]`` (per-token advantages per sample;
    :class:`vime_core.plugins.protocols.AdvantageEstimator`; ``(args, group)`` warns and goes in vime 0.2).

    :param register: call ``register("name", fn)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_dynamic_sampling_filters(register: RegisterDynamicFilter) -> None:
    """Register dynamic sampling filters by name (``--dynamic-sampling-filter NAME``; DAPO, arXiv:2503.14476).

    A filter is ``fn(ctx, group: list[Sample]) -> bool`` (:class:`vime_core.plugins.protocols.DynamicFilter`; ``(args,
    group)`` warns and goes in vime 0.2): True keeps the scored group for training, False drops it (the rollout
    manager samples more prompts to refill the batch).
    Built-in: ``check_reward_nonzero_std``.

    :param register: call ``register("name", fn)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_sandbox_backends(register: RegisterSandbox) -> None:
    """Register sandbox backend classes by name (``--sandbox NAME``).

    A backend is a :class:`vime_core.sandbox.base.Sandbox` subclass whose ``NAME`` is the registered name.

    :param register: call ``register(SandboxClass.NAME, SandboxClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_agent_harnesses(register: RegisterAgent) -> None:
    """Register agent harness classes by name (``--agent NAME``).

    A harness is a :class:`vime_core.agent.harness.AgentHarness` subclass whose ``NAME`` is the registered name.

    :param register: call ``register(HarnessClass.NAME, HarnessClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_weight_sync_strategies(register: RegisterWeightSync) -> None:
    """Register weight-sync strategy classes by name (``--weight-sync NAME``).

    A strategy is a :class:`vime_core.weight_sync.base.WeightSyncStrategy` subclass whose ``NAME`` is the
    registered name.

    :param register: call ``register(StrategyClass.NAME, StrategyClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_trainer_backends(register: RegisterTrainer) -> None:
    """Register trainer backend classes by name (``--trainer NAME``).

    A backend is a :class:`vime_core.trainer.base.TrainerBackend` subclass whose ``NAME`` is the registered name.

    :param register: call ``register(BackendClass.NAME, BackendClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_flags(register: RegisterFlags) -> None:
    """Register the plugin's own ``vime run`` flags: one frozen :class:`vime_core.config.PluginConfig` dataclass
    whose fields are declared with :func:`vime_core.config.flag` under the plugin's prefix (``PREFIX =
    "sandbox-docker"`` → ``--sandbox-docker-*``). The parser, YAML files and ``vime args`` get them from it, and the
    plugin reads them back typed from its context (``ctx.plugin(DockerConfig)``).

    :param register: call ``register(ConfigClass.PREFIX, ConfigClass)``; the registry checks the prefix, that every
        field is a flag with help and a default, and that no other plugin took the prefix.

    .. versionadded:: 0.2
    """


@hookspec(
    warn_on_impl=DeprecationWarning(
        "the vime_add_arguments hook is deprecated and will be removed in vime 0.3: declare the plugin's flags as a "
        "frozen vime_core.config.PluginConfig dataclass and register it with vime_register_flags(register)"
    )
)
def vime_add_arguments(parser: ArgumentParser) -> None:
    """Deprecated (use :func:`vime_register_flags`): add a plugin's own command-line flags by hand, under the
    plugin's prefix. Still called when the parser is built; registering an implementation warns.

    :param parser: the ``vime run`` parser; add an argument group named after the plugin.

    .. versionadded:: 0.1
    .. deprecated:: 0.2
    """


# --------------------------------------------------------------------------------------------------------------
# Observation hooks (called during a run). ``ctx`` is the run's :class:`~vime_core.config.context.PluginContext`;
# ``step`` is the training step (slime's rollout id, 0 .. --num-rollout - 1). ``args`` is the deprecated Namespace of
# vime 0.1 (built from the typed tree): an implementation that names it still gets it, with a DeprecationWarning, until
# vime 0.2.


def _args_deprecated(hook: str, new: str) -> DeprecationWarning:
    return DeprecationWarning(
        f"{hook}(args, ...) is deprecated and stops working in vime 0.2; implement {hook}({new}) "
        "and read the configuration from ctx (vime_core.config.context.PluginContext; docs/hooks.md)"
    )


_ON_SAMPLE_ARGS = _args_deprecated("vime_on_sample", "ctx, sample, step")
_ON_ROLLOUT_END_ARGS = _args_deprecated("vime_on_rollout_end", "ctx, step, samples, metrics")
_ON_TRAIN_STEP_END_ARGS = _args_deprecated("vime_on_train_step_end", "ctx, step, metrics")


@hookspec(warn_on_impl_args={"args": _ON_SAMPLE_ARGS})
def vime_on_sample(ctx: PluginContext, sample: Sample, step: int, args: Namespace) -> None:
    """Called for every sample after generation and reward, before advantages are computed.

    Runs in the **rollout actor** (the Ray actor holding the :class:`~vime_core.rollout.manager.RolloutManager`),
    on its event loop: keep it fast and non-blocking. With ``--loop fully-async`` samples are generated in the
    background before it is known which step will train them, so ``step`` is **-1** there. Not called for
    evaluation samples. May edit the sample in place (e.g. set ``remove_sample``); the return value is ignored.

    .. versionadded:: 0.1
    """


@hookspec(warn_on_impl_args={"args": _ON_ROLLOUT_END_ARGS})
def vime_on_rollout_end(
    ctx: PluginContext, step: int, samples: list[Sample], metrics: dict[str, float], args: Namespace
) -> None:
    """Called once per step after the rollout; may add entries to ``metrics`` (they are logged).

    Runs in the **rollout actor**, with the step's samples (in ``--loop fully-async`` when a batch is handed to
    the trainer, with that batch's real ``step``). Not called for evaluations.

    .. versionadded:: 0.1
    """


@hookspec(warn_on_impl_args={"args": _ON_TRAIN_STEP_END_ARGS})
def vime_on_train_step_end(ctx: PluginContext, step: int, metrics: dict[str, float], args: Namespace) -> None:
    """Called once per step after training and weight sync, with the step's metrics (read-only by convention).

    Runs in the **driver process** (the ``vime run`` process, :mod:`vime_core.run.loop`), after the step's metrics
    are logged; every loop mode calls it with the real ``step``.

    .. versionadded:: 0.1
    """
