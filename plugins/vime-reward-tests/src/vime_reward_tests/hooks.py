"""Hook implementations of vime-reward-tests (import-light: the reward module loads on first use)."""

from __future__ import annotations

from vime_core import hookimpl


async def tests(ctx, sample) -> float:
    """The ``tests`` reward (:func:`vime_reward_tests.reward.tests_reward`); ``ctx`` is the run's
    :class:`~vime_core.config.context.PluginContext`."""
    from vime_reward_tests.reward import tests_reward

    return await tests_reward(ctx, sample)


@hookimpl
def vime_register_reward_functions(register):
    register("tests", tests)


@hookimpl
def vime_register_flags(register):
    from vime_reward_tests.reward import RewardTestsFlags

    register(RewardTestsFlags.PREFIX, RewardTestsFlags)
