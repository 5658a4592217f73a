"""Every vime hook, in one place.

Plugins implement these with ``@vime_core.hookimpl`` in a module named by an entry point of group ``vime``
(entry name = distribution name without the ``vime-`` prefix). Built-ins register through exactly the same hooks
(:data:`vime_core.plugins.DEFAULT_PLUGINS`).

The ``vime_register_*`` hooks receive a ``register(name, obj)`` callback rather than returning values, so the
registry knows which plugin provided each name and can fail loudly on duplicates (see :mod:`vime_core.registry`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from vime_core.types import Sample

hookspec = pluggy.HookspecMarker("vime")
hookimpl = pluggy.HookimplMarker("vime")

Register = Callable[[str, Any], None]

# --------------------------------------------------------------------------------------------------------------
# Registration hooks (called once when the plugin manager is built)


@hookspec
def vime_register_generate_functions(register: Register) -> None:
    """Register generate functions by name (``--generate NAME``).

    A generate function is ``async def generate(args, sample, sampling_params) -> Sample | list[Sample]``: it fills
    ``tokens``/``response``/``loss_mask``/``rollout_log_probs``/``weight_versions``/``status`` of ``sample``.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_reward_functions(register: Register) -> None:
    """Register reward functions by name (``--reward NAME``).

    A reward function is ``async def reward(args, sample) -> float | dict[str, float]``. A reward that raises,
    exceeds ``--reward-timeout`` or returns NaN/±inf/a non-number marks the sample ``failed`` with that cause
    (:mod:`vime_core.failures`): excluded, never scored 0.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_group_reward_functions(register: Register) -> None:
    """Register group reward functions by name (``--group-reward NAME``).

    A group reward function is ``async def reward(args, group: list[Sample]) -> list[float | dict[str, float]]``:
    one score per sample of a prompt's group, in order (pairwise preference, rank-based rewards). It replaces
    ``--reward`` and gets the group's completed/truncated samples once all of them have finished generating.

    :param register: call ``register("name", fn)`` once per function.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators by name (``--advantage-estimator NAME``).

    An estimator is ``fn(args, group: list[Sample]) -> list[list[float]]`` (per-token advantages per sample).

    :param register: call ``register("name", fn)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_dynamic_sampling_filters(register: Register) -> None:
    """Register dynamic sampling filters by name (``--dynamic-sampling-filter NAME``; DAPO, arXiv:2503.14476).

    A filter is ``fn(args, group: list[Sample]) -> bool``: True keeps the scored group for training, False drops it
    (the rollout manager samples more prompts to refill the batch). Built-in: ``check_reward_nonzero_std``.

    :param register: call ``register("name", fn)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_sandbox_backends(register: Register) -> None:
    """Register sandbox backend classes by name (``--sandbox NAME``).

    :param register: call ``register("name", SandboxClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_agent_harnesses(register: Register) -> None:
    """Register agent harness classes by name (``--agent NAME``).

    :param register: call ``register("name", HarnessClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_weight_sync_strategies(register: Register) -> None:
    """Register weight-sync strategy classes by name (``--weight-sync NAME``).

    A strategy is a :class:`vime_core.weight_sync.base.WeightSyncStrategy` subclass.

    :param register: call ``register("name", StrategyClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_register_trainer_backends(register: Register) -> None:
    """Register trainer backend classes by name (``--trainer NAME``).

    A backend is a :class:`vime_core.trainer.base.TrainerBackend` subclass.

    :param register: call ``register("name", BackendClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def vime_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a plugin's own command-line flags, under the plugin's prefix (e.g. ``--sandbox-docker-image``).

    :param parser: the ``vime run`` parser; add an argument group named after the plugin.

    .. versionadded:: 0.1
    """


# --------------------------------------------------------------------------------------------------------------
# Observation hooks (called during a run)


@hookspec
def vime_on_sample(args: argparse.Namespace, sample: Sample, step: int) -> None:
    """Called for every sample after generation and reward, before advantages are computed.

    May edit the sample in place (e.g. set ``remove_sample``); the return value is ignored.

    .. versionadded:: 0.1
    """


@hookspec
def vime_on_rollout_end(args: argparse.Namespace, step: int, samples: list[Sample], metrics: dict[str, float]) -> None:
    """Called once per step after the rollout; may add entries to ``metrics`` (they are logged).

    .. versionadded:: 0.1
    """


@hookspec
def vime_on_train_step_end(args: argparse.Namespace, step: int, metrics: dict[str, float]) -> None:
    """Called once per step after training and weight sync, with the step's metrics (read-only by convention).

    .. versionadded:: 0.1
    """
