"""The typed contracts of the callable plugin kinds, as :class:`typing.Protocol` classes.

Each protocol's ``__call__`` is the signature a registered function must have: the registry checks the parameter
names and ``async`` against it (:func:`vime_core.plugins.registry.check_protocol`), and type checkers check a plugin
that annotates its function with it (``reward: RewardFn = my_reward``). The class kinds are abstract base classes
instead (``Sandbox``, ``AgentHarness``, ``WeightSyncStrategy``, ``TrainerBackend``). The rules: docs/hooks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vime_core.types import Sample

if TYPE_CHECKING:
    from vime_core.config.context import PluginContext

#: what a reward function returns: one score, or named scores (``--reward-key`` picks the trained one)
Reward = float | dict[str, float]


class GenerateFn(Protocol):
    """``--generate NAME``: turn one prompt sample into one or more finished samples.

    Fills ``tokens``/``response``/``loss_mask``/``rollout_log_probs``/``weight_versions``/``status`` of ``sample``
    (see :class:`vime_core.types.Sample` for the length rules). A list is a fan-out: the samples of one episode
    (agent trajectory segments, multi-agent roles); the rollout manager gives them one ``episode_id``, scores the
    episode once and the loss counts it once.

    :param ctx: the run's typed configuration (:class:`vime_core.config.context.PluginContext`; the function's own
        flags: ``ctx.plugin(ItsPluginConfig)``).
    :param sample: the prompt sample (``prompt``, ``label``, ``metadata``; an aborted sample to resume).
    :param sampling_params: vLLM sampling parameters (``temperature``, ``max_tokens``, ...).
    """

    async def __call__(
        self, ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample | list[Sample]: ...


class RewardFn(Protocol):
    """``--reward NAME``: score one finished sample.

    A reward that raises, exceeds ``--reward-timeout`` or returns NaN/±inf/a non-number marks the sample
    ``failed`` (:mod:`vime_core.failures`): excluded from the loss, never scored 0.
    """

    async def __call__(self, ctx: PluginContext, sample: Sample) -> Reward: ...


class GroupRewardFn(Protocol):
    """``--group-reward NAME``: score a prompt's group at once (pairwise preference, rank-based rewards).

    Returns one score per sample of ``group``, in order; gets the group's completed/truncated samples once all of
    them have finished generating.
    """

    async def __call__(self, ctx: PluginContext, group: list[Sample]) -> list[Reward]: ...


class AdvantageEstimator(Protocol):
    """``--advantage-estimator NAME``: per-token advantages of one prompt group's trainable samples.

    Returns one list per sample with ``response_length`` float entries (GRPO broadcasts one value per sample).
    """

    def __call__(self, ctx: PluginContext, group: list[Sample]) -> list[list[float]]: ...


class DynamicFilter(Protocol):
    """``--dynamic-sampling-filter NAME`` (DAPO, arXiv:2503.14476): keep (True) or drop (False) a scored group; the
    rollout manager samples more prompts to refill the batch."""

    def __call__(self, ctx: PluginContext, group: list[Sample]) -> bool: ...
